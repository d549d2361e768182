"""Small layers the packed BERT stack is built from: dropout that can be counted and
replayed, and the activations by their Hugging Face names.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation as GPT-2 and the original BERT code write it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act -> the function (element-wise, no parameters)
FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "gelu_fast": gelu_fast,
    "gelu_pytorch_tanh": gelu_tanh,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


class Activation(nn.Module):
    """A module over one of FUNCTIONS (no parameters, nothing in the state dict)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.function = FUNCTIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)

    def extra_repr(self) -> str:
        return self.name


def activation(name: str) -> nn.Module:
    """config.hidden_act -> a module (transformers' ACT2FN for a name not in FUNCTIONS)."""
    if name in FUNCTIONS:
        return Activation(name)
    from transformers.activations import ACT2FN

    return ACT2FN[name]
