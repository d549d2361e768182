"""Compile once (issue 70, deliver 3): training.compile (the training step compiled once for a
whole run) and --compile of predict and embed (the forward compiled once per row width).

Fixed-shape batches (packed, padded) give every step the same rows x width, so the run's
compiled forward and backward are built at the first step and never again. Counted here
through torch._dynamo's CompileCounterWithBackend over "aot_eager" (the same capture and
AOTAutograd split as inductor, without its C++ build; the product's backend is
engines.torch_engine.COMPILE_BACKEND, inductor): one graph for the run, no graph break, no
recompilation, and the run's losses and weights equal the eager run's. docs/compile.md
measures inductor's time against eager's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.testing import CompileCounterWithBackend

from packed_transformers.common.config_schema import ConfigError
from packed_transformers.engines import torch_engine as step
from packed_transformers.finetune import train as finetune
from packed_transformers.finetune.config import load_finetune_config

from ..decoder_helpers import config_for  # noqa: F401 - the module's fixture
from ..finetune_helpers import write_config  # noqa: F401 - the module's fixture


@pytest.fixture
def counted(monkeypatch):
    """training.compile's backend replaced by a counter of the graphs it is handed."""
    torch._dynamo.reset()  # no graph cached from another test's compiled model
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(step, "COMPILE_BACKEND", counter)
    yield counter
    torch._dynamo.reset()


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(eager_dir, compiled_dir, tolerance):
    """Equal per-epoch metrics and final weights, within float reassociation."""
    for eager, compiled in zip(metrics(eager_dir), metrics(compiled_dir), strict=True):
        for key, value in eager.items():
            if isinstance(value, float):
                assert compiled[key] == pytest.approx(value, rel=tolerance, abs=tolerance), key
    a, b = (load_file(str(folder / "model" / "model.safetensors")) for folder in (eager_dir, compiled_dir))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.slow  # compiles: make test, not the fast loop
@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_a_compiled_classifier_run_builds_one_graph_and_trains_as_eager(tmp_path, checkpoint, counted, mode):  # noqa: F811
    path = write_config(tmp_path, checkpoint, training={"epochs": 2, "progress": False},
                        batching={"batch_size": 8, "max_sequences_per_pack": 4, "mode": mode})  # fmt: skip
    # the compiled run pads each epoch's last batch with empty rows: they hold no example but
    # take dropout draws (the classifier's 0.1), so the eager run it equals pads them too
    eager_config = load_finetune_config(str(path), ["batching.pad_last_batch=true"])
    compiled_config = load_finetune_config(str(path), ["training.compile=true"])
    eager = finetune.run_finetune(eager_config, tmp_path / "eager")
    assert counted.frame_count == 0  # the eager run compiles nothing
    compiled = finetune.run_finetune(compiled_config, tmp_path / "compiled")
    # one graph for 2 epochs of steps (the last batch of each epoch padded to the same rows)
    assert compiled["train_steps"] == eager["train_steps"] > 20
    assert counted.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert compiled["train_examples"] == eager["train_examples"]  # padding rows hold no example
    assert_same_run(tmp_path / "eager", tmp_path / "compiled", 2e-5)


@pytest.mark.slow  # compiles: make test, not the fast loop
def test_a_compiled_sft_run_builds_one_graph_over_rows_that_eager_attends_by_buckets(
    tmp_path,
    start_folder,  # noqa: F811
    counted,
):
    """Rows of 256 tokens: eager attends by length buckets (shapes that follow the data); the
    compiled step takes the row's block-causal mask (the row's shape), one graph for the run."""
    config = config_for(tmp_path, start_folder, epochs=2)
    config["batching"].update(pack_length=256, max_sequences_per_pack=8)
    finetune.run_finetune(config, tmp_path / "eager")
    config["training"]["compile"] = True
    compiled = finetune.run_finetune(config, tmp_path / "compiled")
    assert compiled["train_steps"] >= 4
    assert counted.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert_same_run(tmp_path / "eager", tmp_path / "compiled", 2e-5)
    eager_losses = [
        json.loads(line)["loss"] for line in (tmp_path / "eager" / "validation_predictions.jsonl").open()
    ]
    compiled_losses = [
        json.loads(line)["loss"] for line in (tmp_path / "compiled" / "validation_predictions.jsonl").open()
    ]
    np.testing.assert_allclose(compiled_losses, eager_losses, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mode", ["dynamic", "uniform"])
def test_compile_refuses_batches_whose_width_changes(tmp_path, checkpoint, mode):  # noqa: F811
    path = write_config(tmp_path, checkpoint, batching={"mode": mode})
    with pytest.raises(ConfigError) as refused:
        load_finetune_config(str(path), ["training.compile=true"])
    message = str(refused.value)
    assert "\n" not in message
    assert f"training.compile: batching.mode {mode} changes the row width" in message
    assert "packed or padded" in message


# ----- compiled inference (predict --compile, embed --compile) ----------------------------------
def texts_far_apart_in_length(count: int = 150) -> list[str]:
    """BBC News texts far apart in length (a few words; whole paragraphs), so that packing
    keeps them in different row widths."""
    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    articles = bbc_articles(corpus_glob())[:60]
    short = [" ".join(t.split()[:4]) for t in texts_of(articles, "sentences") if t.strip()]
    long = [t for t in texts_of(articles, "paragraphs") if len(t.split()) > 60]
    return [text for pair in zip(short, long) for text in pair][:count]


@pytest.fixture
def counted_inference(monkeypatch):
    """The Runner's compile backend replaced by a counter of the graphs it is handed."""
    from packed_transformers.inference import torch_backend

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(torch_backend, "COMPILE_BACKEND", counter)
    yield counter
    torch._dynamo.reset()


@pytest.mark.slow  # compiles: make test, not the fast loop
def test_compiled_embedding_builds_one_graph_per_row_width_and_equals_eager(counted_inference):
    """Every table of a row width runs padded to that width's rows (the last table of a
    width is short): graphs = widths, fewer than the batches, and a second pass compiles
    nothing. (Sorted batching would make a width, and a graph, per batch.)"""
    from packed_transformers.data.assets import model_dir
    from packed_transformers.door.opener import ForEmbedding, open_folder
    from packed_transformers.inference.embedding import encode
    from packed_transformers.inference.options import InferenceOptions

    texts = texts_far_apart_in_length()
    encoder = open_folder(model_dir(), ForEmbedding())
    eager = encode(texts, encoder, InferenceOptions.for_embedding(batch_size=16))
    assert counted_inference.frame_count == 0
    options = InferenceOptions.for_embedding(batch_size=16, compile=True)
    compiled = encode(texts, encoder, options)
    runner = encoder._runners[("cpu", "float32", True, "torch")]
    widths = runner._rows_of_width
    assert runner.stats.batches > len(widths)  # several batches at some width
    assert counted_inference.frame_count == len(widths)
    np.testing.assert_allclose(compiled, eager, atol=2e-6)
    again = encode(texts, encoder, options)
    assert counted_inference.frame_count == len(widths)  # nothing compiled again
    np.testing.assert_array_equal(again, compiled)
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.slow  # compiles: make test, not the fast loop
def test_predict_compile_gives_the_eager_predictions(tmp_path, counted_inference):
    """`--compile` reaches the Runner of finetune.predict (a family folder, in this process)."""
    from packed_transformers.commands import predict

    from ..family_helpers import save_family_folder

    folder = save_family_folder(tmp_path / "xlmr", "xlm-roberta", "classification")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts_far_apart_in_length(60)))
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        argv = [
            "--model",
            str(folder),
            "--input",
            str(source),
            "--output",
            str(tmp_path / f"{name}.jsonl"),
            *extra,
        ]
        assert predict.main(argv) == 0
    eager, compiled = (
        [json.loads(line) for line in (tmp_path / f"{n}.jsonl").open()] for n in ("eager", "compiled")
    )
    assert [r["label"] for r in compiled] == [r["label"] for r in eager]
    np.testing.assert_allclose(
        [list(r["scores"].values()) for r in compiled], [list(r["scores"].values()) for r in eager], atol=2e-6
    )
    assert counted_inference.frame_count >= 1
