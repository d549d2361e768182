"""The varlen attention backend (model/varlen.py) against dense: outputs and every
gradient in fp32 without dropout, the distribution with dropout, the static flash layout,
and the classification model."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_transformers.model import varlen as model_varlen
from packed_transformers.model.attention import PackedSelfAttention, build_mask
from packed_transformers.model.bert_heads import PackedBertForSequenceClassification
from packed_transformers.model.config import bert_config
from packed_transformers.model.varlen import varlen_layout


def pack_ids(lengths_per_pack: list[list[int]], s: int) -> torch.Tensor:
    """sequence_ids [B, S]: each pack's sequences back to back from 0, then padding."""
    ids = torch.zeros(len(lengths_per_pack), s, dtype=torch.long)
    for b, lengths in enumerate(lengths_per_pack):
        pos = 0
        for j, length in enumerate(lengths, start=1):
            ids[b, pos : pos + length] = j
            pos += length
    return ids


@st.composite
def packs(draw):
    s = draw(st.sampled_from([16, 40, 64]))
    k = draw(st.integers(1, 4))
    batch = []
    for _ in range(draw(st.integers(1, 4))):
        room, lengths = s, []
        for _ in range(draw(st.integers(0, k))):
            if room == 0:
                break
            length = draw(st.integers(1, room))
            lengths.append(length)
            room -= length
        batch.append(lengths)
    return pack_ids(batch, s), k


def _attention(backend: str, dropout: float = 0.0, hidden: int = 32, heads: int = 4):
    config = bert_config(
        "bert-tiny", hidden_size=hidden, num_attention_heads=heads, attention_probs_dropout_prob=dropout
    )
    config.attention_backend = backend
    torch.manual_seed(3)
    return PackedSelfAttention(config)


def _run(backend, ids, k, hidden_states, dropout=0.0, slots_known=True, dtype=torch.float32):
    attention = _attention(backend, dropout).to(dtype)
    x = hidden_states.clone().requires_grad_(True)
    out = attention(x, build_mask(backend, ids, x.dtype, k if slots_known else None))
    (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(out.shape)).sum().backward()
    # A batch of padding only never reaches query/key in varlen (None): zero, as in dense.
    grads = {
        name: p.grad if p.grad is not None else torch.zeros_like(p)
        for name, p in attention.named_parameters()
    }
    return out.detach(), x.grad, grads


@settings(max_examples=60, deadline=None)
@given(packs(), st.booleans())
def test_varlen_equals_dense_outputs_and_every_gradient(batch, slots_known):
    """fp32: outputs (padding rows included) and input gradients within 1e-5; parameter
    gradients are sums over every token of the batch, whose fp32 summation order differs
    between the two (seen: 1.3e-5 on a 0.97 gradient), so within 5e-5. In float64 every
    gradient agrees to 1e-10: the algorithms are the same, only rounding differs."""
    ids, k = batch
    x = torch.randn(*ids.shape, 32, generator=torch.Generator().manual_seed(int(ids.sum())))
    dense = _run("dense", ids, k, x)
    with torch.autocast("cpu", enabled=False):
        dense64 = _run("dense", ids, k, x.double(), dtype=torch.float64)
    # Both CPU paths: one block-diagonal call (short packs) and length buckets (long ones).
    for block_below in (model_varlen.BLOCK_DIAGONAL_MAX_LENGTH, 0):
        with mock.patch.object(model_varlen, "BLOCK_DIAGONAL_MAX_LENGTH", block_below):
            varlen = _run("varlen", ids, k, x, slots_known=slots_known)
            with torch.autocast("cpu", enabled=False):
                varlen64 = _run("varlen", ids, k, x.double(), slots_known=slots_known, dtype=torch.float64)
        torch.testing.assert_close(varlen[0], dense[0], atol=1e-5, rtol=1e-5)  # padding rows included
        torch.testing.assert_close(varlen[1], dense[1], atol=1e-5, rtol=1e-5)
        for name in dense[2]:
            torch.testing.assert_close(varlen[2][name], dense[2][name], atol=5e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(varlen64[0], dense64[0], atol=1e-10, rtol=1e-10)
        for name in dense64[2]:
            torch.testing.assert_close(varlen64[2][name], dense64[2][name], atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("block_below", [model_varlen.BLOCK_DIAGONAL_MAX_LENGTH, 0])
def test_varlen_dropout_agrees_with_dense_in_distribution(block_below, monkeypatch):
    monkeypatch.setattr(model_varlen, "BLOCK_DIAGONAL_MAX_LENGTH", block_below)
    ids = pack_ids([[10, 20, 2], [31], [5, 5, 5]], 32)
    x = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(0))
    samples = {}
    for backend in ("dense", "varlen"):
        attention = _attention(backend, dropout=0.3).train()
        mask = build_mask(backend, ids, x.dtype, 3)
        with torch.no_grad():
            samples[backend] = torch.stack([attention(x, mask) for _ in range(300)])
    real = ids > 0
    dense, varlen = samples["dense"][:, real], samples["varlen"][:, real]
    assert varlen.std(0).mean() > 0.01  # dropout really acts
    se = torch.sqrt(dense.var(0) / 300 + varlen.var(0) / 300) + 1e-6
    z = ((dense.mean(0) - varlen.mean(0)) / se).abs()
    assert z.mean() < 1.2 and (z > 5).float().mean() < 0.01  # |z| ~ half-normal: mean 0.8
    # and the spread matches: the same dropout on the same probabilities
    ratio = varlen.var(0).mean() / dense.var(0).mean()
    assert 0.85 < ratio < 1.15


def test_flash_layout_is_static_and_exact():
    """cu_seqlens: K+1 segments per pack (sequences in slot order, then the padding tail),
    whatever the data: the CUDA kernel's shapes never change between batches."""
    ids = pack_ids([[3, 2], [6], []], 8)
    layout = varlen_layout(ids, slots=3, flash=True)
    assert layout.cu_seqlens.dtype == torch.int32
    # pack 0: 3, 2, 0, pad 3 | pack 1: 6, 0, 0, pad 2 | pack 2: 0, 0, 0, pad 8
    segments = [3, 2, 0, 3, 6, 0, 0, 2, 0, 0, 0, 8]
    assert layout.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(segments)]).tolist()
    other = varlen_layout(pack_ids([[1, 1, 1], [8], [2]], 8), slots=3, flash=True)
    assert other.cu_seqlens.shape == layout.cu_seqlens.shape
    assert layout.padding.tolist() == (ids.reshape(-1) == 0).tolist()


def test_bucket_layout_puts_every_token_back_once():
    ids = pack_ids([[30, 2, 17], [64], [1, 1, 1, 60], []], 64)
    layout = varlen_layout(ids, slots=4, flash=False, granularity=16)
    assert sorted(layout.order.tolist()) == list(range(ids.numel()))
    covered = torch.cat([index[valid] for index, valid, _, _ in layout.buckets])
    assert sorted(covered.tolist()) == torch.nonzero(ids.reshape(-1)).squeeze(1).tolist()
    for index, valid, _, _ in layout.buckets:  # a bucket holds sequences of similar length
        assert index.shape[1] % 16 == 0 or index.shape[1] == 64
        assert (valid.sum(1) > index.shape[1] - 16).all()


@pytest.mark.parametrize("multi_label", [False, True])
def test_classifier_with_varlen_equals_dense(multi_label):
    torch.manual_seed(0)
    config = bert_config("bert-tiny", vocab_size=100, num_labels=3, hidden_dropout_prob=0.0)
    config.attention_probs_dropout_prob = 0.0
    config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    dense = PackedBertForSequenceClassification(config).eval()
    config_v = bert_config("bert-tiny", vocab_size=100, num_labels=3, hidden_dropout_prob=0.0)
    config_v.attention_probs_dropout_prob, config_v.attention_backend = 0.0, "varlen"
    config_v.problem_type = config.problem_type
    varlen = PackedBertForSequenceClassification(config_v).eval()
    varlen.load_state_dict(dense.state_dict())
    lengths = [[7, 12], [20], [3, 3, 3]]
    ids = pack_ids(lengths, 24)
    positions = torch.zeros_like(ids)
    cls = torch.zeros(3, 3, dtype=torch.long)
    example = torch.full((3, 3), -1)
    n = 0
    for b, row in enumerate(lengths):
        start = 0
        for j, length in enumerate(row):
            positions[b, start : start + length] = torch.arange(length)
            cls[b, j], example[b, j] = start, n
            start, n = start + length, n + 1
    batch = dict(
        input_ids=torch.randint(5, 100, ids.shape) * (ids > 0),
        segment_ids=torch.zeros_like(ids),
        position_ids=positions,
        sequence_ids=ids,
        cls_positions=cls,
        example_index=example,
        labels=torch.randint(0, 2, (3, 3, 3)) if multi_label else torch.randint(0, 3, (3, 3)),
    )
    out_d, out_v = dense(**batch), varlen(**batch)
    present = example >= 0
    torch.testing.assert_close(out_v["logits"][present], out_d["logits"][present], atol=1e-5, rtol=1e-5)
    out_d["loss"].backward()
    out_v["loss"].backward()
    grads = dict(dense.named_parameters())
    for name, p in varlen.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
