"""Parameter groups: weight decay on weights, none on biases and LayerNorm parameters; fine-tuning's
AdamW over them with its schedule (`build_adamw`)."""

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


def build_adamw(model, optim: dict, total_steps: int):
    """AdamW without decay on biases and LayerNorm (weight_decay_groups, the rule pretraining
    uses); optim.WarmupLinearDecay in optimizer steps. -> (optimizer, schedule: step -> lr, which
    engines.torch_engine.take_step writes into the groups). The fused
    kernel (one pass over all parameters, on CPU and CUDA; what transformers' Trainer picks by
    default): torch's default for-loop AdamW was ~13% of a MiniLM step on 2 CPU cores.
    optim: fine-tuning's section (lr, betas, eps, weight_decay, warmup_fraction)."""
    import math

    from packed_transformers.optim.schedules import WarmupLinearDecay

    optimizer = torch.optim.AdamW(
        weight_decay_groups(model.named_parameters(), optim["weight_decay"]),
        lr=optim["lr"],
        betas=tuple(optim["betas"]),
        eps=optim["eps"],
        fused=True,
    )
    schedule = WarmupLinearDecay(
        optim["lr"], max(1, math.ceil(optim["warmup_fraction"] * total_steps)), total_steps
    )
    return optimizer, schedule


def build_lamb(model, optim: dict, betas: tuple[float, float], max_grad_norm: float | None):
    """BERT's LAMB (optim.Lamb) with the run's packing-adjusted `betas`; lr 0 until the
    schedule sets it. optim: pretraining's section (eps, weight_decay, bias_correction).
    `max_grad_norm` is separate because the pipeline engine clips across stages itself."""
    from packed_transformers.optim.lamb import Lamb

    return Lamb(
        weight_decay_groups(model.named_parameters(), optim["weight_decay"]),
        lr=0.0,
        betas=betas,
        eps=optim["eps"],
        weight_decay=optim["weight_decay"],
        bias_correction=optim["bias_correction"],
        max_grad_norm=max_grad_norm,
    )
