"""The CUDA path, on a real GPU. Skipped, with the reason, where torch sees no CUDA device.

What runs here: every attention backend against dense in fp32; the varlen FlashAttention
path in bf16 (with and without attention dropout) against dense in bf16; a bf16 training
step against fp32; torch.compile against eager; fp16 with the gradient scaler; the run
loop on CUDA with a checkpoint and --resume giving the uninterrupted run's weights; the
fine-tuning `predict --device cuda` path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packed_transformers.model import PackedBertForPreTraining, bert_config
from packed_transformers.model.varlen import varlen_layout

from ..model_helpers import group_into_packs, packed_batch, random_sequences
from ..training_helpers import final_weights, metrics, run, write_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

S, K, M, VOCAB = 128, 3, 24, 500


def _batch(seed: int, count: int = 12, device="cuda") -> dict:
    seqs = random_sequences(np.random.default_rng(seed), count, VOCAB, max_len=60, max_predictions=8)
    batch = packed_batch(group_into_packs(seqs, S, K), S, K, M, VOCAB)
    return {name: t.to(device) for name, t in batch.items()}


def _model(backend: str, dropout: float = 0.0, preset: str = "bert-mini") -> PackedBertForPreTraining:
    config = bert_config(
        preset,
        vocab_size=VOCAB,
        attention_backend=backend,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    return PackedBertForPreTraining(config).cuda()


def _loss_and_grads(model, batch):
    """Loss output and {parameter name: gradient}; a compiled module's `_orig_mod.` prefix
    is dropped so that eager and compiled names match."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out["loss"].backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name.removeprefix("_orig_mod.")] = (
            p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        )
    return out, grads


@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen"])
def test_every_backend_equals_dense_in_fp32(backend):
    batch = _batch(0)
    dense = _model("dense").train()
    other = _model(backend).train()
    other.load_state_dict(dense.state_dict())
    out_d, grads_d = _loss_and_grads(dense, batch)
    out_o, grads_o = _loss_and_grads(other, batch)
    torch.testing.assert_close(out_o["loss"], out_d["loss"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_o["mlm_logits"], out_d["mlm_logits"], atol=1e-4, rtol=1e-4)
    for name, g in grads_d.items():
        assert (grads_o[name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-7, name


def test_varlen_uses_flash_in_bf16_and_matches_dense_bf16():
    """bf16 (autocast): varlen runs FlashAttention's varlen kernel over static cu_seqlens.
    Tolerance: both sides round to bf16 (8 bits of mantissa): 2% of the loss, and
    gradients within 5% of their largest element."""
    batch = _batch(1)
    ids = batch["sequence_ids"]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        from packed_transformers.model.varlen import flash_available

        assert flash_available(ids.device, torch.float32)
    layout = varlen_layout(ids, K, flash=True)
    assert layout.cu_seqlens.shape == (ids.shape[0] * (K + 1) + 1,)
    dense, varlen = _model("dense").train(), _model("varlen").train()
    varlen.load_state_dict(dense.state_dict())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_d, grads_d = _loss_and_grads(dense, batch)
        out_v, grads_v = _loss_and_grads(varlen, batch)
    assert abs(out_v["loss"].item() - out_d["loss"].item()) <= 0.02 * out_d["loss"].item()
    for name, g in grads_d.items():
        assert (grads_v[name] - g).abs().max() <= 0.05 * g.abs().max() + 1e-4, name


def test_varlen_flash_attention_dropout_trains_and_agrees_in_distribution():
    batch = _batch(2)
    dense, varlen = _model("dense", dropout=0.1).train(), _model("varlen", dropout=0.1).train()
    varlen.load_state_dict(dense.state_dict())
    losses = {}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, grads = _loss_and_grads(varlen, batch)
        assert torch.isfinite(out["loss"]) and all(torch.isfinite(g).all() for g in grads.values())
        assert grads["bert.encoder.layer.0.attention.self.query.weight"].abs().sum() > 0
        with torch.no_grad():
            for name, model in (("dense", dense), ("varlen", varlen)):
                losses[name] = torch.stack([model(**batch)["loss"].float() for _ in range(200)])
    assert losses["varlen"].std() > 0  # dropout really acts
    se = torch.sqrt(losses["dense"].var() / 200 + losses["varlen"].var() / 200)
    assert (losses["dense"].mean() - losses["varlen"].mean()).abs() < 4 * se


def test_bf16_step_matches_fp32():
    """One LAMB step from the same weights: bf16 autocast vs fp32. Stated tolerance: the
    loss within 1%, and the weight update's direction (cosine similarity) above 0.99."""
    from packed_transformers.optim import Lamb

    batch = _batch(3)
    updates, losses = {}, {}
    for precision in ("fp32", "bf16"):
        model = _model("varlen").train()
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        optimizer = Lamb(model.parameters(), lr=1e-3)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(**batch)
        out["loss"].backward()
        optimizer.step()
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        updates[precision], losses[precision] = after - before, out["loss"].item()
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.01 * losses["fp32"]
    cosine = torch.nn.functional.cosine_similarity(updates["bf16"], updates["fp32"], dim=0)
    assert cosine > 0.99, cosine


@pytest.mark.parametrize("backend, precision", [("dense", "fp32"), ("varlen", "bf16")])
def test_compiled_model_matches_eager(backend, precision):
    batch = _batch(4)
    eager = _model(backend).train()
    compiled_model = _model(backend).train()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out_e, grads_e = _loss_and_grads(eager, batch)
        out_c, grads_c = _loss_and_grads(compiled, batch)
    tol = 1e-4 if precision == "fp32" else 2e-2
    torch.testing.assert_close(out_c["loss"], out_e["loss"], atol=tol, rtol=tol)
    for name, g in grads_e.items():
        assert (grads_c[name] - g).abs().max() <= tol * 10 * g.abs().max() + 1e-4, name


@pytest.mark.parametrize("precision, backend", [("bf16", "varlen"), ("fp16", "sdpa"), ("fp32", "dense")])
def test_run_on_cuda_resumes_to_the_uninterrupted_weights(packed, tmp_path, precision, backend):
    """The run loop on the GPU: 6 steps straight vs 3 steps, checkpoint, --resume 3 more."""
    sections = dict(
        execution={"device": "cuda", "threads": 1},
        training={"max_steps": 6, "precision": precision},
        model={"attention_backend": backend},
    )
    config = write_config(tmp_path / "c.yaml", packed, **sections)
    straight = run(config, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    first = run(config, tmp_path / "split", "--set", "training.max_steps=3")
    assert first.returncode == 0, first.stderr
    second = run(config, tmp_path / "split", "--resume")
    assert second.returncode == 0, second.stderr
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    # Bitwise on CPU; on CUDA some kernels (index_add in embedding backward, atomics in
    # attention backward) are not deterministic, so equality to float noise.
    assert max((a[n].float() - b[n].float()).abs().max().item() for n in a) <= 1e-3
    losses = [r["loss"] for r in metrics(tmp_path / "straight")]
    assert all(np.isfinite(losses))
    assert [r["step"] for r in metrics(tmp_path / "split")] == [1, 2, 3, 4, 5, 6]


def test_compiled_lamb_equals_foreach_lamb():
    """Lamb(compiled=True) (one torch.compile'd update per group) against the foreach path:
    three steps, two parameter groups, clipping on; weights equal to float32 rounding."""
    from packed_transformers.optim import Lamb, weight_decay_groups

    batch = _batch(5)
    weights = {}
    for compiled in (False, True):
        model = _model("varlen").train()
        optimizer = Lamb(
            weight_decay_groups(model.named_parameters(), 0.01),
            lr=1e-3,
            weight_decay=0.01,
            max_grad_norm=1.0,
            compiled=compiled,
        )
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            model(**batch)["loss"].backward()
            optimizer.step()
        weights[compiled] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in weights[False].items():
        torch.testing.assert_close(weights[True][name], w, atol=1e-5, rtol=1e-4, msg=name)


def test_fp8_step_agrees_with_bf16():
    """torchao float8 training of the encoder's Linear layers (bench_gpu.py's fp8 setup) against
    bf16 autocast, one LAMB step from the same weights. Stated tolerance: loss within 2%,
    update direction (cosine) above 0.95 (fp8 keeps 3 mantissa bits on the forward)."""
    torchao_float8 = pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 or newer")
    import sys

    from packed_transformers.optim import Lamb

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "bench"))
    from bench_gpu import fp8_linear_filter

    batch = _batch(6)
    updates, losses = {}, {}
    for kind in ("bf16", "fp8"):
        model = _model("varlen", preset="bert-mini").train()
        if kind == "fp8":
            torchao_float8.convert_to_float8_training(model, module_filter_fn=fp8_linear_filter)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        optimizer = Lamb(model.parameters(), lr=1e-3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        out["loss"].backward()
        optimizer.step()
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        updates[kind], losses[kind] = after - before, out["loss"].item()
    assert abs(losses["fp8"] - losses["bf16"]) <= 0.02 * losses["bf16"]
    cosine = torch.nn.functional.cosine_similarity(updates["fp8"], updates["bf16"], dim=0)
    assert cosine > 0.95, cosine
