"""What predict and embed read and where they write: pipes read once, empty texts and pipes
refused where they cannot be, outputs checked before inference, never inside the model folder,
non-finite scores never written."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ..folder_helpers import one_line_error, run_module, tiny_hub_classifier  # noqa: F401


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_embed_refuses_a_pipe_and_an_empty_text_in_one_line(tmp_path):
    from packed_transformers.data.assets import model_dir

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    line = one_line_error(run_module("packed_transformers.finetune.embed", "--model", model_dir(), "--input", fifo,
                                     "--output", tmp_path / "e.npy"))  # fmt: skip
    assert "not a regular file" in line and "save it to a file first" in line
    texts = tmp_path / "t.jsonl"
    texts.write_text('{"text": "fine"}\n{"text": "   "}\n')
    line = one_line_error(run_module("packed_transformers.finetune.embed", "--model", model_dir(), "--input", texts,
                                     "--output", tmp_path / "e.npy"))  # fmt: skip
    assert line == f"error: {texts}:2: field 'text' is empty"
    assert not (tmp_path / "e.npy").exists()


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_predict_reads_a_pipe_once(tmp_path):
    import json
    import threading

    from ..folder_helpers import TEXTS

    folder = tiny_hub_classifier(tmp_path / "m")
    records = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:5])
    regular = tmp_path / "in.jsonl"
    regular.write_text(records)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(records))
    writer.start()
    piped = run_module(
        "packed_transformers.finetune.predict",
        "--model",
        folder,
        "--input",
        fifo,
        "--output",
        tmp_path / "p.jsonl",
    )
    writer.join(10)
    assert piped.returncode == 0, piped.stderr
    direct = run_module(
        "packed_transformers.finetune.predict",
        "--model",
        folder,
        "--input",
        regular,
        "--output",
        tmp_path / "r.jsonl",
    )
    assert direct.returncode == 0, direct.stderr
    assert (tmp_path / "p.jsonl").read_text() == (tmp_path / "r.jsonl").read_text()


def test_predict_checks_its_output_can_be_written_before_inference(tmp_path, capsys):
    """#10: an output that cannot be written (here: a folder under a file, which root cannot
    write either) is one line before any compute, not a lost finished inference."""
    from packed_transformers.commands import predict

    (tmp_path / "a_file").write_text("x")
    code = predict.main(["--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.jsonl"),
                         "--output", str(tmp_path / "a_file" / "p.jsonl")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "a_file" in err


def test_predict_refuses_an_output_inside_the_model_folder(tmp_path, capsys):
    """#3: `--output M/vocab.txt` no longer replaces the model's vocabulary."""
    from packed_transformers.commands import predict

    model = tmp_path / "model"
    model.mkdir()
    (model / "vocab.txt").write_text("[PAD]\n")
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a"}\n')
    code = predict.main(["--model", str(model), "--input", str(source), "--output", str(model / "vocab.txt")])
    assert code == 2 and "inside" in capsys.readouterr().err
    assert (model / "vocab.txt").read_text() == "[PAD]\n"


def test_scores_that_are_not_finite_are_never_written():
    from packed_transformers.data.classification_data import ExampleError
    from packed_transformers.inference.predictions import prediction_records

    logits = np.array([[0.0, 1.0], [np.nan, 0.0]], dtype=np.float32)
    with pytest.raises(ExampleError, match="example 1: the model's scores are not finite"):
        list(prediction_records(logits, ["a", "b"], multi_label=False))
