"""ONNX Runtime on packed rows (inference/onnx_graphs.py, onnx_session.py) and the torch-free
process (`packed export`, door/exported_folder.py, inference/exported_backend.py): float32 equal to
torch's packed forward per text, int8 within its gate, the same labels for a classifier, and
the exported folder's commands importing neither torch nor transformers (judged on
sys.modules in a fresh process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from packed_transformers.commands import embed as embed_command
from packed_transformers.commands import export as export_command
from packed_transformers.commands import predict as predict_command
from packed_transformers.door.exported_folder import is_exported, load_exported
from packed_transformers.inference.embedding import encode, load_encoder
from packed_transformers.inference.options import InferenceOptions
from packed_transformers.inference.runner import runner_of

from ..conftest import REPO
from ..exported_helpers import NO_TORCH, assert_predicts_as_torch, tiny_texts
from ..model_helpers import cosines

pytest.importorskip("onnxruntime")


@pytest.fixture(autouse=True)
def graph_cache(tmp_path_factory, monkeypatch):
    """Exported graphs kept in this session's temporary folder, never the user's cache."""
    folder = tmp_path_factory.getbasetemp() / "onnx-cache"
    monkeypatch.setenv("PACKED_TRANSFORMERS_CACHE", str(folder))
    return folder / "onnxruntime"


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    """`checkpoint` exported as a mean-pooled, normalised embedding model, float32 and int8."""
    root = tmp_path_factory.mktemp("exported")
    for dtype in ("float32", "int8"):
        argv = ["--model", str(checkpoint), "--output", str(root / dtype), "--pooling", "mean", "--normalize",
                "--dtype", dtype]  # fmt: skip
        assert export_command.main(argv) == 0
    return root


def test_onnxruntime_runner_equals_torch_per_text(checkpoint):
    encoder = load_encoder(checkpoint, pooling=["mean"])
    texts = tiny_texts(30)
    options = InferenceOptions.for_embedding(batch_size=8, max_sequences_per_pack=4)
    torch_vectors = encode(texts, encoder, options)
    vectors = encode(texts, encoder, InferenceOptions.for_embedding(batch_size=8, max_sequences_per_pack=4,
                                                                    runtime="onnxruntime"))  # fmt: skip
    assert cosines(vectors, torch_vectors).min() >= 0.99999
    np.testing.assert_allclose(vectors, torch_vectors, rtol=0, atol=2e-5)
    # one graph for every row shape: another width and slot count run in the same session
    runner = runner_of(encoder, "cpu", "float32", False, "onnxruntime")
    session = runner.backend.session
    ids, _ = encoder.tokenize_texts(["the market", "a film", "team win"], ["a", "b", "c"])
    one = runner.forward(ids, np.array([[0, 1, 2]]), 40, outputs=("embeddings",))
    assert runner.backend.session is session
    expected = encode(["the market", "a film", "team win"], encoder)
    np.testing.assert_allclose(one.outputs["embeddings"][0], expected, rtol=0, atol=2e-5)


def test_the_exported_folder_embeds_as_torch_does(checkpoint, exported, tmp_path):
    texts = tiny_texts(40, seed=1)
    reference = encode(texts, load_encoder(checkpoint, pooling=["mean"], normalize=True))
    assert is_exported(exported / "float32") and not is_exported(checkpoint)
    vectors = encode(texts, load_exported(exported / "float32"))
    assert cosines(vectors, reference).min() >= 0.99999
    int8 = encode(texts, load_exported(exported / "int8"))
    assert cosines(int8, reference).min() >= 0.95  # dynamic int8 of a 32-wide random model
    # the command, with the vectors the API gives and a summary naming the folder's graph
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "e.npy"
    assert embed_command.main(["--model", str(exported / "int8"), "--input", str(source), "--output", str(out),
                               "--quiet"]) == 0  # fmt: skip
    np.testing.assert_allclose(np.load(out), int8, rtol=0, atol=1e-6)


def test_an_exported_folder_refuses_what_its_export_settled(exported, tmp_path, capsys):
    source = tmp_path / "texts.jsonl"
    source.write_text(json.dumps({"text": "a text"}) + "\n")
    out = tmp_path / "e.npy"
    for extra, said in ((["--dtype", "float32"], "graph is int8"), (["--pooling", "cls"], "--pooling was settled"),
                        (["--runtime", "openvino"], "graph is for onnxruntime"),
                        (["--device", "cuda"], "runs on the CPU"),
                        # issue 110 item 4: the advice was `packed export --dtype bfloat16`, which export
                        # refused; now the runtime that exports bf16 is named (issue 106)
                        (["--dtype", "bfloat16"], "needs `packed export --runtime openvino --dtype bfloat16`")):  # fmt: skip
        argv = ["--model", str(exported / "int8"), "--input", str(source), "--output", str(out), *extra]
        assert embed_command.main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
        assert not out.exists()
        for advised in re.findall(r"`(packed export [^`]*)`", err):  # advice export itself takes
            assert export_takes(advised.split()[2:]), err


def export_takes(options: list[str]) -> bool:
    """Whether `packed export` accepts `options` (with a model and an output) and would export
    them here: its parser and its runtime/dtype rule, not a model run."""
    from packed_transformers.commands.export import runtime_problem
    from packed_transformers.commands.parsers import export_parser

    args = export_parser("").parse_args(["--model", "m", "--output", "o", *options])
    return runtime_problem(args.runtime, args.dtype) is None or "needs a CPU" in runtime_problem(
        args.runtime, args.dtype
    )


def test_a_damaged_export_is_one_line(exported, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(exported / "float32", broken)
    info = json.loads((broken / "packed_export.json").read_text())
    (broken / "packed_export.json").write_text(json.dumps({**info, "format": 99}))
    source = tmp_path / "texts.jsonl"
    source.write_text(json.dumps({"text": "a text"}) + "\n")
    assert embed_command.main(["--model", str(broken), "--input", str(source), "--output",
                               str(tmp_path / "e.npy")]) == 2  # fmt: skip
    assert "format 99; this version reads format 1" in capsys.readouterr().err


def test_an_exported_folder_given_to_the_other_command_is_one_line(exported, trained, tmp_path, capsys):
    """Issue 108 item 2: predict on an embedding export ended in KeyError 'logits', embed on a
    classifier export in an AttributeError, export of an export in another: one line each,
    exit 2, nothing written."""
    classifier = tmp_path / "classifier"
    assert export_command.main(["--model", str(trained / "run" / "model"), "--output", str(classifier)]) == 0
    capsys.readouterr()
    source = tmp_path / "texts.jsonl"
    source.write_text(json.dumps({"text": "a text"}) + "\n")
    cases = (
        (predict_command, exported / "float32", tmp_path / "p.jsonl", "`packed embed` runs it"),
        (embed_command, classifier, tmp_path / "e.npy", "`packed predict` runs it"),
    )
    for command, model, out, said in cases:
        assert command.main(["--model", str(model), "--input", str(source), "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1 and str(model) in err, err
        assert list(tmp_path.glob(out.name + "*")) == [] and not out.with_suffix(".summary.json").exists()
    again = tmp_path / "again"
    for model in (exported / "int8", classifier):
        assert export_command.main(["--model", str(model), "--output", str(again)]) == 2
        err = capsys.readouterr().err
        assert "is an exported folder" in err and err.count("\n") == 1, err
        assert not again.exists()


def test_export_replaces_an_earlier_export_with_overwrite_and_nothing_else(checkpoint, tmp_path, capsys):
    """Issue 108 item 4: `--overwrite` over an earlier export said "is a directory; give the
    output file's path"; it replaces it now. A folder holding other files is refused, and a
    second export into a folder another export is writing is refused (its lock), not renamed in
    over the first."""
    from packed_transformers.common.files import lock_folder

    out = tmp_path / "out"
    argv = ["--model", str(checkpoint), "--output", str(out), "--pooling", "mean"]
    assert export_command.main(argv) == 0
    first = (out / "packed_export.json").read_text()
    assert export_command.main(argv) == 2 and "give --overwrite" in capsys.readouterr().err
    assert export_command.main([*argv, "--pooling", "cls", "--overwrite"]) == 0
    replaced = (out / "packed_export.json").read_text()
    assert replaced != first and '"cls"' in replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert export_command.main(["--model", str(checkpoint), "--output", str(other), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "holding other files" in err and err.count("\n") == 1
    assert sorted(os.listdir(other)) == ["notes.txt"]
    busy = tmp_path / "busy"
    lock_folder(busy, "test holding the lock")  # as another export writing it would
    done = subprocess.run([sys.executable, "-m", "packed_transformers.commands.export", "--model", str(checkpoint),
                           "--output", str(busy)], cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and "is in use by another packed export" in done.stderr, done.stderr[-2000:]
    assert not busy.exists()


@pytest.mark.slow  # a whole export in a fresh process under a file-size limit
def test_a_write_that_fails_names_the_output_not_its_temporary(checkpoint, tmp_path):
    """Issue 108 item 4: `error: a file: No space left` named no path, and a failed write named
    the export's temporary folder. A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: EFBIG, the
    way a full disk fails a write) now gives one line naming --output, and nothing is left."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    out = tmp_path / "out" / "export"
    out.parent.mkdir()
    done = subprocess.run([sys.executable, "-m", "packed_transformers", "export", "--model", str(checkpoint),
                           "--output", str(out), "--pooling", "mean"], cwd=REPO, capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[-1].startswith(f"error: --output {out} (nothing was written): "), lines[-1]
    assert "file-size limit" in lines[-1] and ".tmp" not in lines[-1], lines[-1]
    assert list(out.parent.iterdir()) == []


def test_a_bare_encoder_without_pooling_is_told_what_export_takes_not_predict(checkpoint, tmp_path, capsys):
    """Issue 108 item 4: export's refusal of a folder with no head it writes named predict."""
    assert export_command.main(["--model", str(checkpoint), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "packed export writes a *ForSequenceClassification folder" in err, err
    assert "predict" not in err and "--pooling" in err and not (tmp_path / "out").exists()


def test_a_classifier_exports_with_the_same_labels(trained, tmp_path):
    """finetune.train's classifier (WordPiece vocab.txt, labels) exported: predict on the
    folder gives torch's labels and scores."""
    model = trained / "run" / "model"
    folder = tmp_path / "exported"
    assert export_command.main(["--model", str(model), "--output", str(folder)]) == 0
    assert (folder / "vocab.txt").is_file()
    summary = assert_predicts_as_torch(trained, folder, tmp_path)
    assert summary["runtime"] == "onnxruntime" and summary["dtype"] == "float32"
    assert summary["accuracy"] == json.loads((tmp_path / "torch.summary.json").read_text())["accuracy"]


@pytest.mark.parametrize("command", ["embed", "predict"])
def test_the_exported_process_imports_neither_torch_nor_transformers(command, exported, trained, tmp_path):
    if command == "embed":
        source = tmp_path / "texts.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in tiny_texts(5)))
        args = ["packed_transformers.commands.embed", "--model", str(exported / "int8"), "--input", str(source),
                "--output", str(tmp_path / "e.npy"), "--quiet"]  # fmt: skip
    else:
        folder = tmp_path / "classifier"
        assert export_command.main(["--model", str(trained / "run" / "model"), "--output", str(folder),
                                    "--dtype", "int8"]) == 0  # fmt: skip
        args = ["packed_transformers.commands.predict", "--model", str(folder), "--input",
                str(trained / "val.jsonl"), "--output", str(tmp_path / "p.jsonl")]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)  # fmt: skip
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "imported": []}, done.stderr[-2000:]


LIGHT_PYTHON = REPO / ".venv-light" / "bin" / "python"


def test_the_light_install_runs_an_exported_folder(exported, tmp_path):
    """The light install (`make install-light`: requirements-runtime.txt and the package
    without its dependencies, no torch or transformers in the environment at all) embeds
    as the full install does. Skipped where .venv-light is absent (CI builds it: `make test`
    depends on `install-light`)."""
    if not LIGHT_PYTHON.exists():
        pytest.skip("no .venv-light (make install-light)")
    found = subprocess.run([str(LIGHT_PYTHON), "-c", "import importlib.util as u; "
                            "print([m for m in ('torch', 'transformers') if u.find_spec(m)])"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert found.stdout.strip() == "[]"
    source = tmp_path / "texts.jsonl"
    texts = tiny_texts(20, seed=4)
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "light.npy"
    done = subprocess.run([str(LIGHT_PYTHON.parent / "packed"), "embed", "--model", str(exported / "float32"),
                           "--input", str(source), "--output", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["runtime"] == "onnxruntime"
    np.testing.assert_allclose(
        np.load(out), encode(texts, load_exported(exported / "float32")), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("command", ["pretrain", "embedding-texts", "serve"])
def test_the_light_install_answers_a_job_it_cannot_run_in_one_line(command, exported, tmp_path):
    """Issue 108 item 6: in the light install `packed pretrain` ended in ModuleNotFoundError
    (transformers), `packed embedding-texts` in MissingAsset after 24 lines, `packed serve` on an
    exported folder in the same ModuleNotFoundError: one line each, exit 2, nothing written, and
    advice a pip user can follow (not `make install` in a project folder they lack)."""
    if not LIGHT_PYTHON.exists():
        pytest.skip("no .venv-light (make install-light)")
    argv = {
        "pretrain": ["--config", str(REPO / "configs" / "demo.yaml"), "--output-dir", str(tmp_path / "run")],
        "embedding-texts": ["--output", str(tmp_path / "texts.jsonl")],
        "serve": ["--model", str(exported / "float32"), "--port", "18777"],
    }[command]
    done = subprocess.run([str(LIGHT_PYTHON.parent / "packed"), command, *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert "pip install" in lines[0] and "project folder" not in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_light_install_answers_the_servers_module_in_one_line(exported, tmp_path):
    """Issue 108 item 6: `python -m packed_transformers.serving` (the module, not `packed serve`)
    in the light install ended in a ModuleNotFoundError traceback."""
    if not LIGHT_PYTHON.exists():
        pytest.skip("no .venv-light (make install-light)")
    done = subprocess.run([str(LIGHT_PYTHON), "-m", "packed_transformers.serving", "--model", str(exported / "float32"),
                           "--port", "18778"], cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert "not installed in this Python" in lines[0] and "pip install" in lines[0], lines[0]


def test_the_server_runs_onnxruntime_and_exported_folders_as_torch(checkpoint, exported):
    """The server's engine through ONNX Runtime (`packed serve --runtime onnxruntime`) and on an
    exported folder gives torch's vectors for the same texts and table."""
    from packed_transformers.serving.engines import load_engine

    texts = tiny_texts(7, seed=5)
    engines = {
        "torch": load_engine(checkpoint, pooling=["mean"]),
        "onnxruntime": load_engine(checkpoint, pooling=["mean"], runtime="onnxruntime"),
        "exported": load_engine(exported / "float32"),
    }
    assert engines["onnxruntime"].runner.runtime == engines["exported"].runner.runtime == "onnxruntime"
    token_ids, _ = engines["torch"].encoder.tokenize_texts(texts, texts)
    table, width = np.array([[0, 1, 2], [3, 4, -1], [5, 6, -1]]), max(len(t) for t in token_ids) * 3
    vectors = {name: np.stack(engine.run(token_ids, [np.zeros_like(t) for t in token_ids], table, width))
               for name, engine in engines.items()}  # fmt: skip
    np.testing.assert_allclose(vectors["onnxruntime"], vectors["torch"], rtol=0, atol=2e-5)
    reference = vectors["torch"] / np.linalg.norm(
        vectors["torch"], axis=1, keepdims=True
    )  # the export normalises
    ours = vectors["exported"] / np.linalg.norm(vectors["exported"], axis=1, keepdims=True)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-5)


SERVE_NO_TORCH = """
import json, sys
import numpy as np
from packed_transformers.serving.cli import main  # the command's module, as `packed serve` loads it
from packed_transformers.serving.engines import load_engine
engine = load_engine(sys.argv[1])  # what serving.cli's main builds before the app starts
ids, _ = engine.encoder.tokenize_texts(["a text", "another text"], ["a", "b"])
vectors = engine.run(ids, [np.zeros_like(t) for t in ids], np.array([[0, 1]]), 32)
print(json.dumps({"rows": len(vectors), "cold": engine.cold_tokens_per_second() > 0,
                  "imported": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def test_the_server_on_an_exported_folder_imports_neither(exported):
    done = subprocess.run([sys.executable, "-c", SERVE_NO_TORCH, str(exported / "int8")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"rows": 2, "cold": True, "imported": []}
