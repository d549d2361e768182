"""Parameter groups: weight decay on weights, none on biases and LayerNorm parameters."""

from __future__ import annotations

import torch

NO_DECAY_MARKERS = ("bias", "LayerNorm", "layer_norm", "layernorm", "norm.weight", "ln_")


def excluded_from_weight_decay(name: str, parameter: torch.Tensor) -> bool:
    """Biases, LayerNorm gains/biases (named as in Hugging Face BERT) and any 1-D tensor."""
    return parameter.ndim <= 1 or any(marker in name for marker in NO_DECAY_MARKERS)


def weight_decay_groups(named_parameters, weight_decay: float) -> list[dict]:
    """Two groups for an optimizer: `decay` with `weight_decay`, `no_decay` with 0.

    named_parameters: iterable of (name, tensor), e.g. model.named_parameters().
    Frozen tensors (requires_grad False) are left out. Group dicts carry a "name" key.
    """
    decay, no_decay = [], []
    for name, parameter in named_parameters:
        if not parameter.requires_grad:
            continue
        (no_decay if excluded_from_weight_decay(name, parameter) else decay).append(parameter)
    return [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
