"""The step's arithmetic, written once for every engine (torch, pipeline, the PopTorch graph).

An optimizer step covers `gradient_accumulation` micro-batches on each of `replicas`
replicas. Its loss is the mean MLM loss per masked token plus the mean NSP loss per
sequence over the WHOLE step. No engine sees the whole step at once, so each micro-batch
contributes

    micro_batch_loss = mlm_loss_sum * mlm_scale + nsp_loss_sum * nsp_scale
    mlm_scale = 1 / (masked tokens in the step, all replicas)      (`loss_scales`)
    nsp_scale = 1 / (sequences in the step, all replicas)

and the engine SUMS these over micro-batches and replicas (never averages). The counts
come from the host batches before any compute (`step_counts`), so 1 replica x GA
micro-batches and GA replicas x 1 micro-batch are the same computation up to float
summation order. `observe.summarize` reports a window's loss with the same function.

The batch arithmetic (packs and expected sequences per step, after the packing
adjustment) is `BatchArithmetic`, shared by the torch engines and the IPU plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from packed_transformers.components.distributed import all_reduce_
from packed_transformers.optim import AdjustedHyperparameters, adjust_for_packing
from packed_transformers.optim.lamb import tensor_norms


# --------------------------------------------------------------------------------------
# Loss normalisation
# --------------------------------------------------------------------------------------
def step_counts(micro_batches: list[dict], mlm_loss_mode: str, device="cpu", group=None) -> torch.Tensor:
    """float64 [2] on the host: [masked tokens, sequences] of this replica's micro-batches,
    all-reduced over `group` (the data-parallel group; None = all processes).

    In `per_sequence` MLM mode the first entry counts sequences with a masked token (each
    such sequence's mean loss is then averaged over sequences)."""
    mlm = 0
    for batch in micro_batches:
        weights = batch["masked_lm_weights"]
        if mlm_loss_mode == "per_sequence":
            k = batch["next_sentence_weights"].shape[1]
            mlm += sum(int((weights == j).any(dim=1).sum()) for j in range(1, k + 1))
        else:
            mlm += int((weights > 0).sum())
    nsp = sum(int(b["next_sentence_weights"].sum()) for b in micro_batches)
    return all_reduce_(torch.tensor([mlm, nsp], dtype=torch.float64, device=device), group).cpu()


def loss_scales(counts) -> tuple[float, float]:
    """(mlm_scale, nsp_scale) from a step's global [masked tokens, sequences]; a step with
    none of one kind (an all-empty evaluation group, say) scales by 1: its sums are 0."""
    return 1.0 / max(float(counts[0]), 1.0), 1.0 / max(float(counts[1]), 1.0)


def micro_batch_loss(mlm_loss_sum, nsp_loss_sum, mlm_scale, nsp_scale):
    """One micro-batch's share of the step's loss (tensors or floats alike)."""
    return mlm_loss_sum * mlm_scale + nsp_loss_sum * nsp_scale


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient norm is not finite, detected before the optimizer
    moved the weights (the run stops or skips it: training.on_nonfinite)."""


def check_finite_step(step_loss: torch.Tensor, parameters, check_gradients: bool) -> torch.Tensor | None:
    """Raise NonFiniteStep unless the step's summed loss (and, with `check_gradients`,
    the global gradient norm) is finite. One host sync per step: a diverging run must
    stop at its first bad step, not after its good checkpoints were rotated out.
    Returns the global gradient norm (a 0-d tensor on the gradients' device) when it was
    computed, for the optimizer's clipping to reuse."""
    values = [step_loss.detach().float().reshape(1)]
    norm = None
    if check_gradients:
        grads = [p.grad for p in parameters if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(tensor_norms(grads).float())  # whole tensors, also sharded
            values.append(norm.reshape(1))
    values = torch.cat([v.to(values[0].device) for v in values]).cpu()
    if not bool(torch.isfinite(values).all()):
        what = f"loss {values[0].item()}" + (f", gradient norm {values[1].item()}" if len(values) > 1 else "")
        raise NonFiniteStep(what)
    return norm


def weights_finite(parameters) -> bool:
    """Whether this process's weights are all finite (under FSDP2 its own shards: agree over
    processes with components.distributed.any_process). One reduction, one host sync: the
    check before every checkpoint of every run (a checkpoint of non-finite weights is refused)."""
    from packed_transformers.optim.lamb import local_part

    flags = [torch.isfinite(local_part(p.detach())).all() for p in parameters]
    return not flags or bool(torch.stack(flags).all())


def clip_to_norm_(parameters, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) in place: clipping by a global
    norm already computed (check_finite_step's), so the gradients are read once. Under FSDP2
    each process scales its own shards (the norm is every process's)."""
    from packed_transformers.optim.lamb import local_part

    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([local_part(p.grad) for p in parameters if p.grad is not None], coefficient)


# What a compiled training step hands torch.compile (tests count compilations through another backend).
COMPILE_BACKEND = "inductor"


def step_model_of(model: torch.nn.Module, compile_step: bool):
    """The module a training step calls: `model` itself, or its compiled forward with static
    shapes, built at the first step and reused by every batch (fixed-width batching gives
    each batch the same rows x width). Its backward is compiled with it (AOTAutograd);
    weights, optimizer and checkpoints stay `model`'s."""
    return torch.compile(model, backend=COMPILE_BACKEND, dynamic=False) if compile_step else model


# --------------------------------------------------------------------------------------
# What every step does around the loss
# --------------------------------------------------------------------------------------
def set_learning_rate(optimizer, lr: float) -> None:
    """The schedule's value for this step, written into every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def autocast_context(precision: str, device: torch.device):
    """torch.autocast for bf16/fp16 (weights stay fp32); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# --------------------------------------------------------------------------------------
# Batch arithmetic
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchArithmetic:
    """A run's step in packs and in (expected) sequences, after the packing adjustment.

    packs per step     = micro_batch_packs x gradient_accumulation x replicas
    sequences per step ~= packs per step x packing factor (metadata.json's sequences / packs)
    """

    micro_batch_packs: int
    adjusted: AdjustedHyperparameters  # gradient accumulation and betas after the adjustment
    replicas: int
    packing_factor: float

    @classmethod
    def from_config(cls, config: dict, packing_factor: float, replicas: int) -> BatchArithmetic:
        """The only call of the packing adjustment: optim.gradient_accumulation and betas are
        what the user asked for unpacked; this is what the run uses."""
        optim = config["optim"]
        adjusted = adjust_for_packing(
            optim["packing_adjustment"], packing_factor, optim["gradient_accumulation"], tuple(optim["betas"])
        )
        return cls(config["data"]["micro_batch_packs"], adjusted, replicas, packing_factor)

    @property
    def gradient_accumulation(self) -> int:
        return self.adjusted.gradient_accumulation

    @property
    def betas(self) -> tuple[float, float]:
        return tuple(self.adjusted.betas)

    @property
    def packs_per_step(self) -> int:
        return self.micro_batch_packs * self.gradient_accumulation * self.replicas

    @property
    def sequences_per_step(self) -> float:
        return self.packs_per_step * self.packing_factor

    def describe(self) -> str:
        return (
            f"step = {self.replicas} replicas x {self.gradient_accumulation} micro-batches x "
            f"{self.micro_batch_packs} packs = {self.packs_per_step} packs (~{self.sequences_per_step:.0f} "
            "sequences)"
        )
