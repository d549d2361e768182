"""Attention per packed sequence: cost proportional to the sum of l_i^2, not S^2 per pack.

The `varlen` attention backend. Tokens are flattened to [T = B*S]; each pack's
sequences are contiguous runs (sequence_ids 1, 2, ..., K from position 0, then padding),
so a pack is K + 1 segments: its sequences in slot order, then its padding tail.

* CUDA, bf16/fp16: FlashAttention's variable-length kernel over `cu_seqlens`, padded to a
  static length B*(K+1)+1 (absent slots are empty segments) and `max_seqlen` = S, so the
  shapes never depend on the data: torch.compile and CUDA graphs capture it. Without
  dropout through `torch.nn.attention.varlen.varlen_attn` (a custom op); with attention
  dropout through `aten._flash_attention_forward`, the kernel behind it (varlen_attn
  hard-codes dropout 0). NVIDIA's MLPerf BERT runs the same kernel family over packs.
* Otherwise (CPU, or fp32 on CUDA, where flash kernels do not run), for packs of at most
  BLOCK_DIAGONAL_MAX_LENGTH tokens: one SDPA call over the pack with the block-diagonal
  mask. At such lengths (fine-tuning's packs) a single call measured faster on CPU than
  gathering length buckets (BBC News, packs of 72: inference 1.04x, training 1.02x), the
  attention FLOPs saved being a few percent of a step.
* Longer packs (pretraining's 512): sequences are grouped into a few length buckets;
  each bucket is one dense SDPA call over [sequences, heads, L, d] with a key mask, L the
  bucket's length (a multiple of `granularity`), so the cost is about sum_i roundup(l_i)^2.

Padding tokens attend only to themselves in `dense`, so their context is their own value
vector; both paths return exactly that, so every output equals `dense` (to float
rounding), padding positions included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from packed_transformers.model.layers import attention as sdpa_attention

# Packs up to this many tokens attend with one block-diagonal SDPA call when the flash
# kernel does not run (see above); longer ones through length buckets.
BLOCK_DIAGONAL_MAX_LENGTH = 128


@dataclass
class VarlenLayout:
    """Where each pack's sequences are, built once per batch and shared by all layers.

    tokens: T = B * S positions of the flattened batch."""

    batch: int  # B
    length: int  # S
    padding: torch.Tensor  # bool [T]: padding tokens
    # flash path
    cu_seqlens: torch.Tensor | None  # int32 [B*(K+1) + 1]: segment starts (sequences, then padding tail)
    # bucket path
    # (gather index [n, L], key valid [n, L], SDPA key mask [n, 1, 1, L] or None when all
    # valid, flat positions of the valid slots in [n * L])
    buckets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]] | None
    padding_index: torch.Tensor | None  # int64 [padding tokens]
    order: torch.Tensor | None  # int64 [T]: bucket outputs + padding back to token order
    # short packs: bool [B, 1, S, S], True where attention is allowed (padding: itself)
    block_mask: torch.Tensor | None = None


def allowed_pairs(sequence_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, S, S]: True where query token i may attend to key token j (the same
    non-zero sequence id; a padding token only to itself). The one definition of the mask."""
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    real = (sequence_ids != 0)[:, :, None]
    # The diagonal from arange and eq, not torch.eye: PopTorch 3.4 has no handler for
    # aten::eye (its supported_ops.rst lists no eye among the creation ops) and the dense
    # mask is the IPU's form.
    positions = torch.arange(sequence_ids.shape[1], device=sequence_ids.device)
    return (same & real) | (positions[:, None] == positions[None, :])


def varlen_layout(
    sequence_ids: torch.Tensor, slots: int | None, flash: bool, granularity: int = 0
) -> VarlenLayout:
    """sequence_ids [B, S] (1..K per sequence, 0 padding) -> the layout for one path.

    slots: K, the number of sequence slots per pack (static: the width of the batch's
    next_sentence_positions / cls_positions); None reads it from the data (a host sync).
    granularity: bucket lengths' multiple; giving one chooses the bucket path at any S."""
    b, s = sequence_ids.shape
    ids = sequence_ids.long()
    padding = (ids == 0).reshape(-1)
    if slots is None:
        slots = int(ids.max()) if ids.numel() else 0
    block_diagonal = s <= BLOCK_DIAGONAL_MAX_LENGTH and not granularity and not flash
    if not block_diagonal and _may_sync():
        check_contiguous_runs(ids, slots)
    if flash:
        lengths = slot_lengths(ids, slots, torch.int32)
        # slots 1..K, then the padding tail (slot 0) last: [B, K+1]
        segments = torch.cat([lengths[:, 1:], lengths[:, :1]], dim=1).reshape(-1)
        cu = F.pad(torch.cumsum(segments, 0, dtype=torch.int32), (1, 0))
        return VarlenLayout(b, s, padding, cu_seqlens=cu, buckets=None, padding_index=None, order=None)
    if block_diagonal:
        return VarlenLayout(
            b,
            s,
            padding,
            cu_seqlens=None,
            buckets=None,
            padding_index=None,
            order=None,
            block_mask=allowed_pairs(ids)[:, None],
        )
    return _bucket_layout(ids, padding, slots, granularity or _default_granularity(s))


def _may_sync() -> bool:
    """False while tracing or capturing a CUDA graph, where a host read is not allowed
    (the loader has checked the same rules on the host: packs.structure)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_contiguous_runs(ids: torch.Tensor, slots: int) -> None:
    """ValueError unless every row of ids [B, S] is runs 1, 2, ..., k (k <= slots) from
    position 0 followed by padding 0: the flash and bucket layouts place sequence j at
    the count of tokens of slots < j, which is exact for that layout only. (The
    block-diagonal path compares ids pairwise and is exact for any ids.) One host sync."""
    real = ids > 0
    prefix = torch.arange(ids.shape[1], device=ids.device)[None, :] < real.sum(1, keepdim=True)
    step = ids[:, 1:] - ids[:, :-1]
    jumps = real[:, 1:] & real[:, :-1] & (step != 0) & (step != 1)
    starts_at_one = (ids[:, 0] == 1) | ~real[:, 0]
    ok = (real == prefix).all() & ~jumps.any() & starts_at_one.all() & (ids.max() <= slots)
    if not bool(ok):
        raise ValueError(
            f"varlen attention: sequence_ids must be contiguous runs 1, 2, ..., k <= {slots} from position 0 "
            "with padding (0) after them; use the dense or sdpa backend for other layouts"
        )


def slot_lengths(ids: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, K+1] token counts per pack: column j of sequence j, column 0 of the padding."""
    lengths = torch.zeros(ids.shape[0], slots + 1, dtype=dtype, device=ids.device)
    return lengths.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))


def _default_granularity(s: int) -> int:
    """Bucket lengths are multiples of this: at most 8 buckets, multiples of 8."""
    return max(8, -(-s // 8 // 8) * 8)


def _bucket_layout(ids: torch.Tensor, padding: torch.Tensor, slots: int, granularity: int) -> VarlenLayout:
    b, s = ids.shape
    # Sequence j of pack p starts at the count of tokens of slots < j (contiguous runs).
    lengths = slot_lengths(ids, slots, torch.int64)[:, 1:]  # [B, K]
    starts = torch.cumsum(lengths, 1) - lengths
    present = lengths > 0
    flat_start = (starts + torch.arange(b, device=ids.device)[:, None] * s)[present]  # [N]
    flat_length = lengths[present]  # [N]
    bucket_of = (flat_length + granularity - 1) // granularity  # bucket index = rounded length / g
    buckets, placed = [], []
    for key in torch.unique(bucket_of).tolist():  # a handful of buckets: host loop is cheap
        members = torch.nonzero(bucket_of == key).squeeze(1)
        width = min(int(key) * granularity, s)
        offsets = torch.arange(width, device=ids.device)
        valid = offsets[None, :] < flat_length[members, None]  # [n, L]
        # Invalid slots read the sequence's first token: any real index will do, they are masked.
        index = flat_start[members, None] + torch.where(valid, offsets[None, :], 0)
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        buckets.append((index, valid, mask, torch.nonzero(valid.reshape(-1)).squeeze(1)))
        placed.append(index[valid])
    padding_index = torch.nonzero(padding).squeeze(1)
    placed.append(padding_index)
    order = torch.empty(b * s, dtype=torch.int64, device=ids.device)
    order[torch.cat(placed)] = torch.arange(b * s, device=ids.device)
    return VarlenLayout(
        b, s, padding, cu_seqlens=None, buckets=buckets, padding_index=padding_index, order=order
    )


def varlen_attention(q, k, v, layout: VarlenLayout, dropout: float) -> torch.Tensor:
    """q, k, v [B, heads, S, d] -> context [B, heads, S, d], attention within each sequence."""
    if layout.block_mask is not None:  # a short pack: one block-diagonal call
        return sdpa_attention(q, k, v, layout.block_mask, dropout)
    b, heads, s, d = q.shape
    q_t, k_t, v_t = (x.transpose(1, 2).reshape(b * s, heads, d) for x in (q, k, v))  # [T, heads, d]
    if layout.cu_seqlens is not None:
        context = _flash(q_t, k_t, v_t, layout, dropout)
    else:
        context = attend_by_buckets(
            q_t, k_t, v_t, layout, lambda qb, kb, vb, bucket: sdpa_attention(qb, kb, vb, bucket[2], dropout)
        )
    # Padding attends only to itself (as in dense): its context is its own value.
    context = torch.where(layout.padding[:, None, None], v_t, context)
    return context.reshape(b, s, heads, d).transpose(1, 2)


def _flash(q, k, v, layout: VarlenLayout, dropout: float) -> torch.Tensor:
    cu, s = layout.cu_seqlens, layout.length
    if dropout > 0:
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, s, s, dropout, False, False)
        return out[0]
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, s, s)


def attend_by_buckets(q, k, v, layout: VarlenLayout, attend) -> torch.Tensor:
    """q, k, v [T, heads, d] -> context [T, heads, d]: each length bucket of `layout` gathered to
    [n, heads, L, d], attended by `attend(q, k, v, bucket)` (bucket: the layout's (index, key
    valid, key mask, valid flat positions)), scattered back; padding tokens get their own value.
    BERT's varlen backend and the families' packed attention (model.causal_buckets) share it."""
    # index_select everywhere, not advanced indexing: its backward (index_add_) is much
    # cheaper on CPU than advanced indexing's accumulate-scatter.
    heads, d = q.shape[1], q.shape[2]
    outputs = []
    for bucket in layout.buckets:
        index, _, _, valid_flat = bucket
        n, width = index.shape
        flat = index.reshape(-1)
        # [n, L, heads, d] -> [n, heads, L, d]
        qb, kb, vb = (x.index_select(0, flat).view(n, width, heads, d).transpose(1, 2) for x in (q, k, v))
        out = attend(qb, kb, vb, bucket)
        out = out.transpose(1, 2).reshape(n * width, heads, d)
        outputs.append(out.index_select(0, valid_flat))  # [tokens of the bucket, heads, d]
    outputs.append(v.index_select(0, layout.padding_index))  # padding attends only to itself
    return torch.cat(outputs).index_select(0, layout.order)


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether q, k, v will be fp16/bf16 on CUDA (hidden states in half precision, or
    autocast to it): FlashAttention's varlen kernel runs there only."""
    if device.type != "cuda":
        return False
    half = (torch.float16, torch.bfloat16)
    return dtype in half or (torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in half)
