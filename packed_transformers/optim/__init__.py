"""Optimizers and hyperparameter logic (LAMB, schedules, packing-aware adjustment). Never
knows the model's class; never imports model/ or any room above it.
"""

from packed_transformers.optim.lamb import Lamb
from packed_transformers.optim.packing_adjustment import (
    PACKING_ADJUSTMENTS,
    AdjustedHyperparameters,
    adjust_for_packing,
    packing_factor_from_metadata,
)
from packed_transformers.optim.param_groups import build_adamw, build_lamb, weight_decay_groups
from packed_transformers.optim.poptorch_mapping import poptorch_lamb_kwargs
from packed_transformers.optim.schedules import WarmupCosineDecay, WarmupLinearDecay, WarmupPolyDecay

__all__ = [
    "Lamb",
    "PACKING_ADJUSTMENTS",
    "AdjustedHyperparameters",
    "adjust_for_packing",
    "packing_factor_from_metadata",
    "build_adamw",
    "build_lamb",
    "weight_decay_groups",
    "poptorch_lamb_kwargs",
    "WarmupCosineDecay",
    "WarmupLinearDecay",
    "WarmupPolyDecay",
]
