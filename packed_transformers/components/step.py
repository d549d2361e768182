"""What every engine's step shares, and what a job says of its loss: BERT's loss arithmetic
(the torch, pipeline and PopTorch engines' own), `StepLoss` (a job's loss terms and their units;
`MeanLoss` for a model that returns its mean loss), `NonFiniteStep` (a step an engine refused),
the weights' finiteness before a checkpoint, the learning rate written into the groups and the
batch arithmetic. The torch engine's step itself is engines.torch_engine.take_step.

BERT's loss is the mean MLM loss per masked token plus the mean NSP loss per sequence over
the WHOLE step:

    micro_batch_loss = mlm_loss_sum * mlm_scale + nsp_loss_sum * nsp_scale
    mlm_scale = 1 / (masked tokens in the step, all replicas)      (`loss_scales`)
    nsp_scale = 1 / (sequences in the step, all replicas)

which the pipeline and PopTorch engines compute with the same functions (`step_counts`);
`observe.summarize` reports a window's loss with them. The batch arithmetic (packs and
expected sequences per step, after the packing adjustment) is `BatchArithmetic`, shared by
the torch engines and the IPU plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from packed_transformers.components.distributed import all_reduce_
from packed_transformers.optim import AdjustedHyperparameters, adjust_for_packing


# --------------------------------------------------------------------------------------
# Loss normalisation
# --------------------------------------------------------------------------------------
def batch_counts(batch: dict, mlm_loss_mode: str) -> tuple[int, int]:
    """One micro-batch's [masked tokens, sequences] on the host. In `per_sequence` MLM mode the
    first counts sequences with a masked token (each such sequence's mean loss is then
    averaged over sequences)."""
    weights = batch["masked_lm_weights"]
    if mlm_loss_mode == "per_sequence":
        k = batch["next_sentence_weights"].shape[1]
        mlm = sum(int((weights == j).any(dim=1).sum()) for j in range(1, k + 1))
    else:
        mlm = int((weights > 0).sum())
    return mlm, int(batch["next_sentence_weights"].sum())


def step_counts(micro_batches: list[dict], mlm_loss_mode: str, device="cpu", group=None) -> torch.Tensor:
    """float64 [2] on the host: [masked tokens, sequences] of this replica's micro-batches
    (batch_counts), all-reduced over `group` (the data-parallel group; None = all processes)."""
    counts = [batch_counts(batch, mlm_loss_mode) for batch in micro_batches]
    total = torch.tensor([sum(c[0] for c in counts), sum(c[1] for c in counts)], dtype=torch.float64)
    return all_reduce_(total.to(device), group).cpu()


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


def weights_finite(parameters) -> bool:
    """Whether this process's weights are all finite (under FSDP2 its own shards: agree over
    processes with components.distributed.any_process). One reduction, one host sync: the
    check before every checkpoint of every run (a checkpoint of non-finite weights is refused)."""
    from packed_transformers.optim.lamb import local_part

    flags = [torch.isfinite(local_part(p.detach())).all() for p in parameters]
    return not flags or bool(torch.stack(flags).all())


# --------------------------------------------------------------------------------------
# What a job says of its loss
# --------------------------------------------------------------------------------------
class StepLoss(Protocol):
    """What a job tells the step about its loss; the step does the rest."""

    def units(self, batch: dict) -> Sequence[float]:
        """Each loss term's units in one micro-batch (host tensors), counted before compute."""

    def loss_sums(self, out: dict) -> Sequence[torch.Tensor]:
        """Each term's differentiable loss sum over the micro-batch's own units (0-d tensors)."""

    def kept(self, out: dict, batch: dict):
        """What the job keeps of a micro-batch's outputs (detached) once the step passed."""


@dataclass(frozen=True)
class MeanLoss:
    """The StepLoss of a model whose outputs hold its mean loss over its own units ("loss")
    and their count (`count`): every fine-tuning head, a causal LM. Its one term's sum is the
    mean times that count."""

    units: Callable[[dict], tuple]  # (host batch) -> (units,), counted before compute
    count: str  # the output holding the model's own count of them
    kept: Callable[[dict, dict], object]  # (outputs, host batch) -> what the job keeps

    def loss_sums(self, out: dict):
        return (out["loss"] * out[self.count],)


def predicted_tokens(batch: dict) -> tuple[int]:
    """A causal LM's units: the tokens with a next-token target (shift_labels >= 0; -100 none)."""
    return (int((batch["shift_labels"] >= 0).sum()),)


def set_learning_rate(optimizer, lr: float) -> None:
    """The schedule's value for this step, written into every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


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
