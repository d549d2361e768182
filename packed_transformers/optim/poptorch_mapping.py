"""Keyword arguments for `poptorch.optim.LAMB` from the same settings as optim.Lamb.

Pure: imports neither poptorch nor the model. The IPU backend calls
`poptorch.optim.LAMB(**poptorch_lamb_kwargs(...))`.
"""

from __future__ import annotations

import torch

from packed_transformers.optim.packing_adjustment import AdjustedHyperparameters

ACCUM_TYPES = {"float32": torch.float32, "float16": torch.float16}


def poptorch_lamb_kwargs(
    param_groups: list[dict],
    lr: float,
    adjusted: AdjustedHyperparameters,
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = False,
    max_weight_norm: float | None = None,
    loss_scaling: float | None = None,
    accum_type: str = "float32",
    first_order_type: str = "float32",
    second_order_type: str = "float32",
) -> dict:
    """poptorch.optim.LAMB(params, lr, betas, eps, weight_decay, bias_correction,
    loss_scaling, max_weight_norm, accum_type, first_order_momentum_accum_type,
    second_order_momentum_accum_type): betas are the packing-adjusted ones (beta^p).

    Groups keep their own weight_decay (0 for biases and LayerNorm)."""
    for name, value in (
        ("accum_type", accum_type),
        ("first_order_type", first_order_type),
        ("second_order_type", second_order_type),
    ):
        if value not in ACCUM_TYPES:
            raise ValueError(f"{name} must be one of {sorted(ACCUM_TYPES)}, got {value!r}")
    groups = [
        {"params": g["params"], "weight_decay": g.get("weight_decay", weight_decay)} for g in param_groups
    ]
    return {
        "params": groups,
        "lr": lr,
        "betas": tuple(adjusted.betas),
        "eps": eps,
        "weight_decay": weight_decay,
        "bias_correction": bias_correction,
        "loss_scaling": loss_scaling,
        "max_weight_norm": max_weight_norm,
        "accum_type": ACCUM_TYPES[accum_type],
        "first_order_momentum_accum_type": ACCUM_TYPES[first_order_type],
        "second_order_momentum_accum_type": ACCUM_TYPES[second_order_type],
    }
