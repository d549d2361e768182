"""IpuEngine through the real run loop on CPU, against the PopTorch-rules double in
tests/doubles/poptorch (never product code; its docstring lists each rule and its source,
and what a double cannot show). Evaluation in the loop and at the end, checkpoints,
--resume, 1 and 2 replicas, a 2-IPU pipeline. Losses must equal the torch CPU engine's."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from training.config import validate
from training.run import run_training

from .training_helpers import base_config, make_packed

DOUBLES = Path(__file__).resolve().parent / "doubles"


@pytest.fixture
def poptorch_double(monkeypatch):
    for name in [m for m in sys.modules if m == "poptorch" or m.startswith("poptorch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(DOUBLES))
    import poptorch

    assert "doubles" in poptorch.__file__, "the double, never a real poptorch, in this test"
    poptorch._ATTACHED.clear()
    from training.backends.ipu import IpuEngine

    yield IpuEngine
    # Leave no double behind: other tests look for a real poptorch.
    for name in [m for m in sys.modules if m == "poptorch" or m.startswith("poptorch.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_packed(tmp_path_factory.mktemp("ipu-double-data"))


def _configs(packed, replicas=1, **training):
    common = dict(
        model={"attention_backend": "dense", "hidden_dropout": 0.0, "attention_dropout": 0.0},
        optim={"max_grad_norm": None, "gradient_accumulation": 5, "bias_correction": False},
        training={"max_steps": 4, **training},
        # Evaluation every step: the last in-loop evaluation is followed by the at-end one.
        eval={"at_end": True, "every_samples": 1},
    )
    ipu = base_config(packed, **copy.deepcopy(common))
    ipu["execution"] = {"device": "ipu-model", "layers_per_stage": [1, 1], "threads": 1}
    ipu["ipu"] = dict(
        replicas=replicas,
        ipus_per_replica=2,
        half=False,
        stochastic_rounding=False,
        replicated_tensor_sharding=False,
        recompute_checkpoints=False,
    )
    cpu = base_config(packed, **copy.deepcopy(common))
    cpu["optim"]["gradient_accumulation"] = 5 * replicas  # the same global batch
    return validate(ipu), validate(cpu)


def _rows(output):
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("replicas", [1, 2])
def test_ipu_engine_trains_and_evaluates_like_the_cpu_engine(packed, tmp_path, poptorch_double, replicas):
    ipu, cpu = _configs(packed, replicas)
    assert run_training(cpu, tmp_path / "cpu") == 0
    assert run_training(ipu, tmp_path / "ipu", engine_class=poptorch_double) == 0
    a, b = _rows(tmp_path / "cpu"), _rows(tmp_path / "ipu")
    train = lambda rows: [r["loss"] for r in rows if r["kind"] == "train"]  # noqa: E731
    evals = lambda rows: [r for r in rows if r["kind"] == "eval"]  # noqa: E731
    assert train(b) == pytest.approx(train(a), abs=1e-5)
    assert len(evals(b)) == len(evals(a)) >= 2
    for x, y in zip(evals(a), evals(b)):
        assert y["mlm_accuracy"] == pytest.approx(x["mlm_accuracy"], abs=1e-5)
        assert y["masked_tokens"] == x["masked_tokens"]  # padded micro-batches add nothing
    assert list((tmp_path / "ipu" / "checkpoints").glob("step-*"))


def test_resume_on_the_ipu_engine_is_exact(packed, tmp_path, poptorch_double):
    ipu, _ = _configs(packed, 1, checkpoint_every_steps=2)
    assert run_training(ipu, tmp_path / "straight", engine_class=poptorch_double) == 0
    first = copy.deepcopy(ipu)
    first["training"]["max_steps"] = 2
    assert run_training(first, tmp_path / "split", engine_class=poptorch_double) == 0
    assert run_training(ipu, tmp_path / "split", resume=True, engine_class=poptorch_double) == 0
    train = lambda rows: [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]  # noqa: E731
    assert train(_rows(tmp_path / "split")) == train(_rows(tmp_path / "straight"))


def test_the_double_refuses_what_poptorch_refuses(poptorch_double):
    import poptorch
    import torch

    with pytest.raises(TypeError):
        poptorch.optim.LAMB([torch.nn.Parameter(torch.zeros(2))], lr=0.1, max_grad_norm=1.0)  # R9
    model = torch.nn.Linear(2, 2)
    opts = poptorch.Options()
    opts.deviceIterations(2)
    executor = (
        poptorch.inferenceModel(lambda **k: None, opts) if False else poptorch.inferenceModel(model, opts)
    )
    with pytest.raises(RuntimeError, match="Model has not been compiled"):
        executor.detachFromDevice()
    with pytest.raises(RuntimeError, match="not been compiled"):
        _ = executor.rng_state  # R7
