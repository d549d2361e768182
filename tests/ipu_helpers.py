"""The IPU double's configs and the comparison of a CPU run with an IPU-double run.

Shared by several test modules (no test module imports another)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from packed_transformers.training.config import validate

from .training_helpers import base_config

DOUBLES = Path(__file__).resolve().parent / "doubles"


def _configs(packed, replicas=1, layers=(1, 1), ipu_keys=None, gradient_accumulation=5, **training):
    common = dict(
        model={"attention_backend": "dense", "hidden_dropout": 0.0, "attention_dropout": 0.0},
        optim={
            "max_grad_norm": None,
            "gradient_accumulation": gradient_accumulation,
            "bias_correction": False,
        },
        training={"max_steps": 4, **training},
        # Evaluation every step: the last in-loop evaluation is followed by the at-end one.
        eval={"at_end": True, "every_samples": 1},
    )
    ipu = base_config(packed, **copy.deepcopy(common))
    ipu["execution"] = {"device": "ipu-model", "layers_per_stage": list(layers), "threads": 1}
    ipu["ipu"] = dict(
        replicas=replicas,
        ipus_per_replica=len(layers),
        half=False,
        stochastic_rounding=False,
        replicated_tensor_sharding=False,
        recompute_checkpoints=False,
        **(ipu_keys or {}),
    )
    cpu = base_config(packed, **copy.deepcopy(common))
    cpu["optim"]["gradient_accumulation"] = gradient_accumulation * replicas  # the same global batch
    return validate(ipu), validate(cpu)


def _assert_same_run(cpu_output, ipu_output):
    a, b = _rows(cpu_output), _rows(ipu_output)
    train = lambda rows: [r["loss"] for r in rows if r["kind"] == "train"]  # noqa: E731
    evals = lambda rows: [r for r in rows if r["kind"] == "eval"]  # noqa: E731
    assert train(b) == pytest.approx(train(a), abs=1e-5)
    assert len(evals(b)) == len(evals(a)) >= 2
    for x, y in zip(evals(a), evals(b)):
        assert y["mlm_accuracy"] == pytest.approx(x["mlm_accuracy"], abs=1e-5)
        assert y["masked_tokens"] == x["masked_tokens"]  # padded micro-batches add nothing
    assert list((ipu_output / "checkpoints").glob("step-*"))


def _rows(output):
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
