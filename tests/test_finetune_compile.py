"""training.compile (issue 70, deliver 3): the training step compiled once for a whole run.

Fixed-shape batches (packed, padded) give every step the same rows x width, so the run's
compiled forward and backward are built at the first step and never again. Counted here
through torch._dynamo's CompileCounterWithBackend over "aot_eager" (the same capture and
AOTAutograd split as inductor, without its C++ build; the product's backend is
finetune.train.COMPILE_BACKEND, inductor): one graph for the run, no graph break, no
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

from common.config_schema import ConfigError
from finetune import train as finetune
from finetune.config import load_finetune_config

from .test_decoder_sft import config_for, start_folder  # noqa: F401 - the module's fixture
from .test_finetune_run import checkpoint, write_config  # noqa: F401 - the module's fixture


@pytest.fixture
def counted(monkeypatch):
    """training.compile's backend replaced by a counter of the graphs it is handed."""
    torch._dynamo.reset()  # no graph cached from another test's compiled model
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(finetune, "COMPILE_BACKEND", counter)
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
