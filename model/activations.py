"""The feed-forward activations of config.json's `hidden_act`, by transformers' names.

transformers' own table (transformers.activations.ACT2FN) is not imported for these: its
module imports the hub-kernel integration, which brings in torch._dynamo,
torch.distributed.tensor and sympy (about 2 s of a command's start-up on this project's
machine). Each function here computes what transformers' class of that name computes
(tests/test_activations.py compares them bit for bit); a name not listed is taken from
transformers' table, imported then.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


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
