"""Attention per packed sequence for the families' packed rows (decoders causal, encoders
bidirectional): cost about the sum of roundup(l_i)^2, not S^2 per row.

The mask path (`PackedLayout.allowed`) draws a [B, 1, S, S] mask and runs one SDPA call over
every row: each query meets all S keys, the other sequences' only to be masked away. Here the
row's sequences are gathered into a few length buckets (model.varlen's bucket layout, shared
with BERT's varlen backend); a bucket is one dense SDPA call over [sequences, heads, L, d]
with each sequence at offset 0, L the bucket's length. A causal sequence then needs no mask
at all: its keys at offsets past its length are later than any of its queries, so SDPA's
`is_causal` (whose CPU kernel skips the blocks above the diagonal) excludes them. A sliding
window adds a band; a bidirectional bucket masks the keys past each sequence's length.

Padding tokens attend only to themselves, as on the mask path, so their output is their own
value vector: every output equals the mask path's to float rounding, padding included.

The rows must be model.varlen's contiguous runs (sequence ids 1, 2, ..., k from position 0,
then padding): `bucket_plan` returns None for any other layout, and the mask path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from packed_transformers.model.varlen import VarlenLayout, attend_by_buckets, varlen_layout

# Rows up to this many tokens attend through the mask: at such lengths one SDPA call
# measured no slower on CPU than gathering buckets (as BERT's BLOCK_DIAGONAL_MAX_LENGTH).
MASK_MAX_LENGTH = 128


def bucket_granularity(length: int) -> int:
    """Bucket lengths are multiples of this: at most 64 buckets per batch, multiples of 16.
    Finer than BERT's 8 buckets: a decoder's rows are long (up to 8192) and hold documents of
    very different lengths, where a coarse bucket pads a short document to a long one."""
    return max(16, -(-length // 64 // 16) * 16)


def bucket_plan(sequence_ids: torch.Tensor, granularity: int | None = None) -> VarlenLayout | None:
    """sequence_ids [B, S] -> the bucket layout, or None where the mask path runs instead
    (rows of at most MASK_MAX_LENGTH tokens unless `granularity` is given, or rows that are
    not contiguous runs). One host sync (the bucket sizes are data)."""
    length = sequence_ids.shape[1]
    if granularity is None:
        if length <= MASK_MAX_LENGTH:
            return None
        granularity = bucket_granularity(length)
    try:
        return varlen_layout(sequence_ids, None, flash=False, granularity=granularity)
    except ValueError:  # not contiguous runs: the mask path is exact for any layout
        return None


def bucket_attention(
    query, key, value, plan: VarlenLayout, causal: bool, window: int | None, dropout: float, scale
) -> torch.Tensor:
    """query [B, heads, S, d], key and value [B, heads, S, d] (grouped heads already
    repeated) -> context [B, S, heads, d] (transformers' attention-function layout).

    window: causal, keys fewer than `window` back (i - j < window); bidirectional, keys at most
    `window` apart (|i - j| <= window); None: no window."""
    b, heads, s, d = query.shape
    q_t, k_t, v_t = (x.transpose(1, 2).reshape(b * s, heads, d) for x in (query, key, value))  # [T, heads, d]

    def attend(qb, kb, vb, bucket):
        mask = _bucket_mask(qb.shape[2], bucket[1], causal, window, query.device)
        return F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale
        )

    return attend_by_buckets(q_t, k_t, v_t, plan, attend).reshape(b, s, heads, d)


def _bucket_mask(width: int, valid: torch.Tensor, causal: bool, window, device) -> torch.Tensor | None:
    """bool mask for one bucket ([L, L] or [n, 1, 1|L, L]; True = may attend), or None where
    SDPA's own is_causal is the whole rule (causal, no window)."""
    if causal and window is None:
        return None
    offsets = torch.arange(width, device=device)
    back = offsets[:, None] - offsets[None, :]  # i - j
    if causal:  # keys past a sequence's length are later than its queries: the band suffices
        return (back >= 0) & (back < window)
    keys = valid[:, None, None, :]  # [n, 1, 1, L]: a bidirectional query must not see them
    if window is None:
        return None if bool(valid.all()) else keys
    return keys & (back.abs() <= window)
