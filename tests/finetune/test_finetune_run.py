"""Fine-tuning and inference commands end to end on a tiny checkpoint, and their bad input."""

import json
import re

import numpy as np
import pytest
import torch

from packed_transformers.commands import predict
from packed_transformers.data.classification_data import (
    ExampleError,
    read_bbc_news,
    read_jsonl,
    split_by_seed,
)
from packed_transformers.finetune import train as finetune
from packed_transformers.packs.batching import BATCHING_MODES

from ..finetune_helpers import (  # noqa: F401
    CLASSES,
    TOPIC,
    WORDS,
    write_config,
    write_jsonl,  # noqa: F401
)


@pytest.mark.parametrize("mode", BATCHING_MODES)
def test_finetune_learns_and_predict_returns_input_order(tmp_path, checkpoint, mode):
    config = write_config(tmp_path, checkpoint)
    out = tmp_path / "run"
    assert (
        finetune.main(["--config", str(config), "--output-dir", str(out), "--set", f"batching.mode={mode}"])
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["batching"] == mode
    assert summary["train_examples"] == 8 * 120  # every example once per epoch
    assert summary["validation_accuracy"] > 0.8  # keywords decide the class: learnable
    if mode == "packed":
        assert summary["examples_per_row"] > 1.5
    # The inference command on the validation file, in another batching mode, gives the
    # run's own validation predictions, line for line.
    other = BATCHING_MODES[(BATCHING_MODES.index(mode) + 1) % len(BATCHING_MODES)]
    preds = tmp_path / "preds.jsonl"
    argv = ["--model", str(out / "model"), "--input", str(tmp_path / "val.jsonl"), "--output", str(preds)]
    assert predict.main([*argv, "--batching", other, "--batch-size", "7"]) == 0
    mine = [json.loads(line) for line in (out / "validation_predictions.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in preds.read_text().splitlines()]
    assert [r["index"] for r in theirs] == list(range(30))
    assert [r["label"] for r in theirs] == [r["label"] for r in mine]
    np.testing.assert_allclose(
        [list(r["scores"].values()) for r in theirs], [list(r["scores"].values()) for r in mine], atol=1e-4
    )
    report = json.loads(preds.with_suffix(".summary.json").read_text())
    assert report["accuracy"] == pytest.approx(summary["validation_accuracy"])


def test_multi_label_run(tmp_path, checkpoint):
    config = write_config(tmp_path, checkpoint, data={"multi_label": True, "labels": CLASSES})
    # Each example carries its topic and, for sport, also "culture": two labels.
    for name, n, seed in (("train", 120, 0), ("val", 30, 1)):
        write_jsonl(
            tmp_path / f"{name}.jsonl",
            n,
            seed,
            label_of=lambda c: [CLASSES[c]] + (["culture"] if c == 2 else []),
        )
    out = tmp_path / "run"
    assert (
        finetune.main(["--config", str(config), "--output-dir", str(out), "--set", "training.epochs=4"]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["validation_roc_auc"] > 0.8 and summary["validation_roc_auc_classes"] == 3
    first = json.loads((out / "validation_predictions.jsonl").read_text().splitlines()[0])
    assert (
        isinstance(first["labels"], list)
        and len(first["scores"]) == 3
        and all(isinstance(k, str) for k in first["scores"])
    )


def run_expecting_error(tmp_path, config, capsys, *extra, code=2):
    assert finetune.main(["--config", str(config), "--output-dir", str(tmp_path / "run"), *extra]) == code
    return capsys.readouterr().err


def test_label_outside_the_class_range(tmp_path, checkpoint, capsys):
    config = write_config(tmp_path, checkpoint, data={"labels": CLASSES})
    write_jsonl(tmp_path / "train.jsonl", 5, 0, label_of=lambda c: 3)
    err = run_expecting_error(tmp_path, config, capsys)
    assert "train.jsonl:1: label 3 is outside the class range 0..2" in err


def test_unknown_label_name(tmp_path, checkpoint, capsys):
    config = write_config(tmp_path, checkpoint, data={"labels": CLASSES})
    write_jsonl(tmp_path / "val.jsonl", 5, 0, label_of=lambda c: "weather")
    err = run_expecting_error(tmp_path, config, capsys)
    assert "val.jsonl:1: label 'weather' is not one of the 3 classes" in err


def test_empty_text(tmp_path, checkpoint, capsys):
    config = write_config(tmp_path, checkpoint)
    path = tmp_path / "train.jsonl"
    lines = path.read_text().splitlines()
    lines[4] = json.dumps({"text": "  ", "label": "sport"})
    path.write_text("\n".join(lines) + "\n")
    err = run_expecting_error(tmp_path, config, capsys)
    assert "train.jsonl:5: the text is empty" in err


def test_too_long_refused_or_truncated_by_config(tmp_path, checkpoint, capsys, caplog):
    config = write_config(tmp_path, checkpoint, data={"max_sequence_length": 12, "too_long": "error"})
    err = run_expecting_error(tmp_path, config, capsys)
    assert "tokens > data.max_sequence_length 12" in err and "train.jsonl:" in err
    out = tmp_path / "ok"
    args = [
        "--config",
        str(config),
        "--output-dir",
        str(out),
        "--set",
        "data.too_long=truncate",
        "--set",
        "training.epochs=1",
    ]
    assert finetune.main(args) == 0
    assert json.loads((out / "summary.json").read_text())["truncated"] > 0
    assert "examples truncated to 12 tokens" in caplog.text


def test_vocabulary_that_differs_from_the_checkpoint(tmp_path, checkpoint, capsys):
    other = tmp_path / "other_vocab.txt"
    tokens = (checkpoint / "vocab.txt").read_text().splitlines()
    tokens[7], tokens[8] = tokens[8], tokens[7]
    other.write_text("\n".join(tokens) + "\n")
    config = write_config(tmp_path, checkpoint, data={"vocab_file": str(other)})
    err = run_expecting_error(tmp_path, config, capsys)
    assert "differs from the checkpoint's" in err and "at line 8" in err
    bigger = tmp_path / "bigger_vocab.txt"
    bigger.write_text("\n".join(tokens + ["extra"]) + "\n")
    (tmp_path / "ck").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "ck" / name).write_bytes((checkpoint / name).read_bytes())
    config = write_config(tmp_path, tmp_path / "ck", data={"vocab_file": str(bigger)})
    err = run_expecting_error(tmp_path, config, capsys)
    assert "embeds vocab_size=" in err


def test_config_errors_name_the_key(tmp_path, checkpoint, capsys):
    config = write_config(tmp_path, checkpoint)
    err = run_expecting_error(tmp_path, config, capsys, "--set", "batching.mode=bucketed")
    assert "batching.mode: 'bucketed' is not one of padded, dynamic, uniform, packed" in err
    err = run_expecting_error(tmp_path, config, capsys, "--set", "batching.batch=4")
    assert "did you mean 'batching.batch_size'" in err


def test_finished_output_is_not_overwritten(tmp_path, checkpoint, capsys):
    config = write_config(tmp_path, checkpoint, training={"epochs": 1})
    args = ["--config", str(config), "--output-dir", str(tmp_path / "run")]
    assert finetune.main(args) == 0
    assert finetune.main(args) == 2
    assert "holds a finished run" in capsys.readouterr().err
    (tmp_path / "run" / "notes.txt").write_text("mine")  # not the run's: --overwrite leaves it
    first = (tmp_path / "run" / "summary.json").read_text()
    assert finetune.main([*args, "--overwrite"]) == 0  # on purpose: replaced
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "run" / "summary.json").read_text() != first  # a new run's timings
    assert finetune.main([*args, "--overwrite", "--resume"]) == 2


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok", "label": "a"}\n{"text": 5, "label": "a"}\n')
    with pytest.raises(ExampleError, match=r"bad.jsonl:2: field 'text' must be a string"):
        read_jsonl(path, "text", "text_pair", "label")
    path.write_text('{"text": "ok", "label": "a"}\nnot json\n')
    with pytest.raises(ExampleError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl(path, "text", "text_pair", "label")


def test_bbc_news_corpus_reads_title_and_first_sentence():
    from packed_transformers.data.assets import corpus_glob

    examples = read_bbc_news(corpus_glob())
    assert len(examples) == 2225
    assert sorted(set(examples.labels)) == ["business", "entertainment", "politics", "sports", "tech"]
    assert all(t.strip() for t in examples.texts) and all(examples.pairs)
    assert len(examples.notes) == 1 and "cp1252" in examples.notes[0]
    assert examples.texts[0] == "Ad sales boost Time Warner profit"
    assert examples.pairs[0].startswith("Quarterly profits at US media giant TimeWarner jumped 76%")
    train, val = split_by_seed(len(examples), 0.2, 1234)
    assert len(val) == 445 and not set(train) & set(val)
    assert np.array_equal(val, split_by_seed(len(examples), 0.2, 1234)[1])


def test_configs_readme_lists_every_finetune_key():
    from packed_transformers.common.config_schema import markdown
    from packed_transformers.finetune.config import SCHEMA
    from tests.conftest import REPO

    assert markdown(SCHEMA) in (REPO / "configs" / "README.md").read_text()


@pytest.mark.slow  # a whole fine-tuning run of the real MiniLM, ~8-10 s
def test_bbc_demo_config_runs_on_the_real_model(tmp_path):
    """configs/finetune_bbc.yaml as shipped (MiniLM-L6, BBC News), cut to a few seconds."""
    from tests.conftest import REPO

    out = tmp_path / "bbc"
    args = ["--config", str(REPO / "configs" / "finetune_bbc.yaml"), "--output-dir", str(out)]
    args += ["--set", "training.max_seconds=2", "--set", "training.progress=false"]
    assert finetune.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["batching"] == "packed" and summary["examples_per_row"] > 1.9
    assert summary["train_padding_fraction"] < 0.05 and summary["truncated"] == 0
    assert len((out / "validation_predictions.jsonl").read_text().splitlines()) == 445
    info = json.loads((out / "model" / "finetune.json").read_text())
    assert info["labels"] == ["business", "entertainment", "politics", "sports", "tech"]


def test_diverging_finetune_stops_at_the_step_with_one_line(tmp_path, checkpoint, capsys):
    """Issue 22, D1: a learning rate that blows the loss up stops the run at the first
    non-finite loss, naming the epoch and step (it used to die later in scikit-learn)."""
    config = write_config(
        tmp_path, checkpoint, optim={"lr": 1e6, "max_grad_norm": 0.0}, training={"epochs": 3}
    )
    err = run_expecting_error(tmp_path, config, capsys, code=3)  # a diverging run: exit 3, as pretraining's
    assert re.search(r"diverged: epoch 0, step \d+: non-finite loss", err), err
    assert len(err.strip().splitlines()) == 1


def test_a_finite_loss_with_an_overflowing_backward_stops_before_the_weights_move():
    """The one divergence rule (engines.torch_engine.check_finite_step) in fine-tuning's step: a
    finite loss whose gradient is not finite stops the step, the weights untouched (it used to
    be clipped into them: a finite loss was all the step checked)."""
    from packed_transformers.components.step import NonFiniteStep
    from packed_transformers.engines.torch_engine import StepSettings, TorchStep
    from packed_transformers.finetune.train import build_adamw, finetune_step

    class Overflow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight):
            ctx.shape = weight.shape
            return weight.sum()

        @staticmethod
        def backward(ctx, grad):
            return torch.full(ctx.shape, float("inf"))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return {"loss": Overflow.apply(self.weight) * x.sum(), "count": torch.tensor(1)}

    class OneExample:  # a StepLoss of one unit a step, keeping nothing
        def units(self, batch):
            return (1,)

        def loss_sums(self, out):
            return (out["loss"] * out["count"],)

        def kept(self, out, batch):
            return {}

    model = Model()
    optimizer, schedule = build_adamw(model, {"lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.0, "warmup_fraction": 0.0}, 10)  # fmt: skip
    settings = StepSettings(torch.device("cpu"), max_grad_norm=1.0)
    with pytest.raises(NonFiniteStep, match=r"loss 3.0, gradient norm inf"):
        finetune_step(
            TorchStep(model, optimizer, model, settings), {"x": torch.ones(1)}, schedule(0), loss=OneExample()
        )
    assert torch.equal(model.weight.detach(), torch.ones(3)) and model.weight.grad is None


def test_predict_refuses_to_overwrite_its_input_and_bad_sizes(tmp_path, checkpoint, capsys):
    """Issue 22, D18 and D13: --output equal to --input, and --batch-size 0, exit 2 with
    one line; the input is untouched."""
    config = write_config(tmp_path, checkpoint, training={"epochs": 1})
    assert finetune.main(["--config", str(config), "--output-dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    texts = write_jsonl(tmp_path / "texts.jsonl", 5, 3, labels=False)
    before = texts.read_text()
    model = str(tmp_path / "run" / "model")
    assert predict.main(["--model", model, "--input", str(texts), "--output", str(texts)]) == 2
    assert "also an input" in capsys.readouterr().err and texts.read_text() == before
    out = str(tmp_path / "p.jsonl")
    assert predict.main(["--model", model, "--input", str(texts), "--output", out, "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err


def test_predict_takes_texts_longer_than_training_up_to_the_models_maximum(tmp_path, checkpoint):
    """Issue 28: a new text longer than the training length (32, also the pack length) is
    predicted, not a refusal of the whole file; one beyond the model's 64 positions is
    truncated to them and counted. Every mode gives the same predictions."""
    config = write_config(tmp_path, checkpoint, training={"epochs": 1}, batching={"pack_length": 32})
    assert finetune.main(["--config", str(config), "--output-dir", str(tmp_path / "run")]) == 0
    texts = tmp_path / "long.jsonl"
    lines = [{"text": "market shares"}, {"text": " ".join(["film"] * 50)}, {"text": " ".join(["goal"] * 200)}]
    texts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    scores = {}
    for mode in BATCHING_MODES:
        out = tmp_path / f"{mode}.jsonl"
        argv = ["--model", str(tmp_path / "run" / "model"), "--input", str(texts), "--output", str(out)]
        assert predict.main([*argv, "--batching", mode]) == 0
        scores[mode] = [list(json.loads(line)["scores"].values()) for line in out.read_text().splitlines()]
        assert json.loads(out.with_suffix(".summary.json").read_text())["truncated"] == 1
    for mode in BATCHING_MODES:
        np.testing.assert_allclose(scores[mode], scores["padded"], atol=1e-4)


def test_a_run_a_time_limit_cut_short_says_so_and_predict_warns(tmp_path, checkpoint, capsys):
    """Issue 110 item 2: `training.max_seconds` allowed 10 of 55 steps and nothing said so (the
    model predicted "sports" for everything). Now the last line, summary.json and predict say it;
    a run that took all its steps says nothing."""
    config = write_config(
        tmp_path, checkpoint, training={"epochs": 2, "progress": False, "max_seconds": 1e-6}
    )
    out = tmp_path / "run"
    assert finetune.main(["--config", str(config), "--output-dir", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    note = json.loads((out / "summary.json").read_text())["undertrained"]
    assert re.fullmatch(
        r"stopped by training.max_seconds=1e-06 after 1 of \d+ steps: the model is undertrained.*", note
    )
    assert err[-1] == f"warning: {note}"
    source = tmp_path / "new.jsonl"
    source.write_text(json.dumps({"text": "some words"}) + "\n")
    assert (
        predict.main(
            ["--model", str(out / "model"), "--input", str(source), "--output", str(tmp_path / "p.jsonl")]
        )
        == 0
    )
    assert f"warning: --model {out / 'model'}: {note}" in capsys.readouterr().err
    whole = tmp_path / "whole"
    full = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})
    assert finetune.main(["--config", str(full), "--output-dir", str(whole)]) == 0
    assert "undertrained" not in json.loads((whole / "summary.json").read_text())
    assert "warning" not in capsys.readouterr().err


def test_predict_says_a_missing_field_before_the_model_loads(trained, tmp_path, capsys):
    """Issue 108 item 8: a missing field was reported only after the model loaded. A copy of a
    fine-tuned folder without its weights shows the order: the input's line is the one said."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(trained / "run" / "model", model, ignore=shutil.ignore_patterns("*.safetensors"))
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text here"}) + "\n")
    out = tmp_path / "p.jsonl"
    assert predict.main(["--model", str(model), "--input", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{source}:2: field 'text' is missing" in err, err
    assert not out.exists()
    (source).write_text(json.dumps({"text": "fine"}) + "\n")  # the input right: now the weights are missed
    assert predict.main(["--model", str(model), "--input", str(source), "--output", str(out)]) == 2
    assert "field" not in capsys.readouterr().err
