"""Dropout, and attention with dropout, as cheap as a CPU allows.

torch's dropout draws its mask with `bernoulli_`, which on CPU costs about 1.5x a uniform
draw and a compare (profiled: ~10% of a MiniLM fine-tuning step on 2 cores, hidden and
attention-probability dropout together). Here the mask is `uniform >= p`: each element is
kept with probability exactly 1 - p and scaled by 1 / (1 - p), as torch's dropout does;
only the random stream differs. On other devices (CUDA fuses dropout into its kernels;
PopTorch maps nn.Dropout to its own op) torch's dropout is used unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """x with each element zeroed with probability p, the rest scaled by 1 / (1 - p)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training=True)
    keep = torch.empty_like(x).uniform_().ge_(p).mul_(1.0 / (1.0 - p))
    return x * keep


class Dropout(nn.Module):
    """nn.Dropout with `dropout` above (no parameters: state dicts are unchanged)."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x):
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def attention(q, k, v, mask, p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with dropout p on the probabilities (0 in eval).

    q [..., Lq, d], k and v [..., Lk, d]; mask: bool (True = may attend), an additive float
    mask, or None. Without dropout (or off the CPU) this is scaled_dot_product_attention,
    whose fused kernels need no probabilities; with dropout on CPU, SDPA would take its
    math path anyway (softmax, bernoulli_, matmul): the same steps with the cheaper mask."""
    if p == 0.0 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    return dropout(torch.softmax(scores, dim=-1), p, True) @ v
