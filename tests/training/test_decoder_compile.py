"""Decoder pretraining compiled (`training.compile`, issue 81: what BERT's run has): every
micro-batch has one shape, so the run compiles one graph, and its steps and weights are the
eager run's (the compiled forward takes the row's mask instead of the length buckets and runs
the LM head on every token: the same sums, rounded differently)."""

from __future__ import annotations

import pytest
import torch

from ..training_helpers import decoder_rows, final_weights, metrics, pretrain_decoder

pytestmark = pytest.mark.slow  # run_pretraining.py processes


def test_a_compiled_run_compiles_one_graph_and_equals_the_eager_run(tmp_path):
    decoder_rows(tmp_path / "rows" / "train")
    decoder_rows(tmp_path / "rows" / "eval", lengths=(8, 20, 31, 4) * 3, seed=1)
    sets = ("training.max_steps=3", "optim.gradient_accumulation=2")
    eager = pretrain_decoder(tmp_path / "rows", tmp_path / "eager", *sets)
    assert eager.returncode == 0, eager.stderr[-3000:]
    compiled = pretrain_decoder(tmp_path / "rows", tmp_path / "compiled", *sets, "training.compile=true",
                                "training.compile_backend=aot_eager")  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert "torch.compile: 1 graph(s) compiled for the run" in compiled.stderr
    a, b = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert all(abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(a, b)), (a, b)
    wa, wb = final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled")
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5) for k in wa)
