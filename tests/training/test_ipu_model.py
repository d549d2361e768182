"""On Graphcore's IPUModel simulator: the compiled, pipelined, replicated BERT trains
like the CPU backend (losses within 1e-5, as Graphcore's cpu_ipu_test). Needs poptorch
(the Poplar SDK); skipped with that reason anywhere else."""

from __future__ import annotations

import json

import pytest

poptorch = pytest.importorskip("poptorch", reason="poptorch not installed")

from packed_transformers.engines.ipu import IpuEngine  # noqa: E402
from packed_transformers.training.config import validate  # noqa: E402
from packed_transformers.training.run import run_training  # noqa: E402

from ..training_helpers import base_config  # noqa: E402

pytestmark = pytest.mark.ipu


def _config(packed, device, **ipu):
    sections = dict(
        model={"attention_backend": "dense", "hidden_dropout": 0.0, "attention_dropout": 0.0},
        optim={"max_grad_norm": None, "gradient_accumulation": 5, "bias_correction": False},
        training={"max_steps": 4},
        eval={"at_end": True},
        execution={"device": device, "layers_per_stage": [1, 1] if device != "cpu" else None},
    )
    if device != "cpu":
        sections["ipu"] = dict(
            replicas=1,
            ipus_per_replica=2,
            half=False,
            stochastic_rounding=False,
            replicated_tensor_sharding=False,
            recompute_checkpoints=False,
            **ipu,
        )
    return validate(base_config(packed, **sections))


def _losses(output):
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


@pytest.mark.parametrize(
    "ipu", [{}, {"replicas": 2}, {"embedding_serialization_factor": 2, "onehot_gather": False}]
)
def test_ipu_model_trains_like_the_cpu_backend(packed, tmp_path, ipu):
    cpu_config = _config(packed, "cpu")
    if ipu.get("replicas") == 2:  # same global batch: GA 5 x 2 replicas on IPU, GA 10 on CPU
        cpu_config["optim"]["gradient_accumulation"] = 10
    assert run_training(cpu_config, tmp_path / "cpu") == 0
    assert run_training(_config(packed, "ipu-model", **ipu), tmp_path / "ipu", engine_class=IpuEngine) == 0
    cpu_losses, cpu_eval = _losses(tmp_path / "cpu")
    ipu_losses, ipu_eval = _losses(tmp_path / "ipu")
    assert ipu_losses == pytest.approx(cpu_losses, abs=1e-5)
    assert ipu_eval[-1]["mlm_accuracy"] == pytest.approx(cpu_eval[-1]["mlm_accuracy"], abs=1e-5)
    assert ipu_eval[-1]["masked_tokens"] == cpu_eval[-1]["masked_tokens"]  # padding packs add nothing


def test_compile_only_on_the_ipu_model_writes_no_run(packed, tmp_path, caplog):
    config = _config(packed, "ipu-model")
    config["execution"]["compile_only"] = True
    caplog.set_level("INFO")
    assert run_training(config, tmp_path / "out", engine_class=IpuEngine) == 0
    assert not (tmp_path / "out").exists()
    assert "IPU inference graph compiled" in " ".join(r.getMessage() for r in caplog.records)
