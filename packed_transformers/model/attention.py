"""Block-diagonal self-attention for packs, three interchangeable backends.

The mask comes from `sequence_ids` [B, S] (1..K for tokens of the K-th sequence, 0 for
padding): token i may attend to token j iff they carry the same non-zero id. Padding
tokens attend only to themselves, which keeps their softmax finite; their outputs are
never read by a loss.

* dense: explicit additive float mask [B, 1, S, S] (0 or the dtype's minimum), plain
  matmul + softmax: static shapes, the IPU form.
* sdpa:  torch.nn.functional.scaled_dot_product_attention with a boolean mask.
* flex:  FlexAttention with a document mask (block-sparse; compiled on CUDA). It has no
  attention dropout, so it refuses to run in training with dropout > 0.
* varlen: attention per sequence (model/varlen.py): FlashAttention's variable-length
  kernel on CUDA in bf16/fp16 (static cu_seqlens), length buckets of dense SDPA
  elsewhere; cost ~ sum of l_i^2 instead of S^2 per pack.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from packed_transformers.model.layers import attention as sdpa_attention
from packed_transformers.model.layers import dropout as dropout_
from packed_transformers.model.varlen import allowed_pairs, flash_available, varlen_attention, varlen_layout


def additive_mask(sequence_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float [B, 1, S, S]: 0 where attention is allowed, the dtype's minimum elsewhere."""
    allowed = allowed_pairs(sequence_ids)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=sequence_ids.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


class PackedSelfAttention(nn.Module):
    """Multi-head self-attention with HF BERT's parameter names (query, key, value)."""

    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob
        self.backend = config.attention_backend

    def forward_rows(self, hidden: torch.Tensor, rows: torch.Tensor, row_mask) -> torch.Tensor:
        """Attention whose queries are only `rows` of the sequence: the last layer of a model
        that reads a few positions (a classifier's [CLS]) needs no other query.

        hidden [B, S, H] (keys and values), rows [B, R, H] (the queries' hidden states),
        row_mask bool [B, 1, R, S] (`rows_mask`) -> context [B, R, H]. Every backend's
        attention within a sequence is this same softmax over the query's own sequence."""
        q, k, v = (
            self._split(self.query(rows)),
            self._split(self.key(hidden)),
            self._split(self.value(hidden)),
        )
        context = sdpa_attention(q, k, v, row_mask, self.dropout_p if self.training else 0.0)
        b, _, r, _ = context.shape
        return context.transpose(1, 2).reshape(b, r, self.heads * self.head_size)

    def _split(self, x):  # [B, S, H] -> [B, heads, S, head_size]
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_size).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, mask) -> torch.Tensor:
        """hidden [B, S, H]; mask as built by `build_mask` for this backend. -> [B, S, H]."""
        q, k, v = (
            self._split(self.query(hidden)),
            self._split(self.key(hidden)),
            self._split(self.value(hidden)),
        )
        dropout = self.dropout_p if self.training else 0.0
        if self.backend == "dense":
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_size) + mask
            probs = dropout_(torch.softmax(scores, dim=-1), dropout, self.training)
            context = probs @ v
        elif self.backend == "sdpa":
            context = sdpa_attention(q, k, v, mask, dropout)
        elif self.backend == "varlen":
            context = varlen_attention(q, k, v, mask, dropout)
        else:
            if dropout > 0:
                raise ValueError(
                    "attention_backend 'flex' has no attention dropout, but "
                    f"attention_probs_dropout_prob = {self.dropout_p} in training; set it to 0.0 "
                    "or use the 'sdpa' or 'dense' backend"
                )
            from torch.nn.attention.flex_attention import flex_attention

            context = flex_attention(q, k, v, block_mask=mask)
        b, _, s, _ = context.shape
        return context.transpose(1, 2).reshape(b, s, self.heads * self.head_size)


def rows_mask(sequence_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, R, S]: the query at `positions` [B, R] may attend to the tokens of its own
    sequence (padding: to padding, which is never read; never an empty row)."""
    own = torch.gather(sequence_ids, 1, positions.long())  # [B, R]
    return (sequence_ids[:, None, :] == own[:, :, None])[:, None]


def build_mask(backend: str, sequence_ids: torch.Tensor, dtype: torch.dtype, slots: int | None = None):
    """The per-batch mask object each backend consumes (built once, shared by all layers).

    slots: K, sequence slots per pack (varlen: a static segment count; None reads the
    data's largest sequence id)."""
    if backend == "dense":
        return additive_mask(sequence_ids, dtype)
    if backend == "sdpa":
        return allowed_pairs(sequence_ids)[:, None]
    if backend == "varlen":
        return varlen_layout(sequence_ids, slots, flash=flash_available(sequence_ids.device, dtype))
    from torch.nn.attention.flex_attention import create_block_mask

    ids = sequence_ids

    def document(b, h, q_idx, kv_idx):
        return ((ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] != 0)) | (q_idx == kv_idx)

    b, s = ids.shape
    return create_block_mask(document, B=b, H=None, Q_LEN=s, KV_LEN=s, device=ids.device)
