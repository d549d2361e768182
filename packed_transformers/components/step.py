"""The step, written once for every job on the torch engine (BERT pretraining, decoder
pretraining, every fine-tuning task), and its arithmetic shared with the pipeline and PopTorch
engines.

`take_step` is the only place that turns micro-batches into an optimizer step:

    units   each loss term's units (masked tokens, sequences, examples, predicted tokens)
            counted on the host for every micro-batch before any compute, summed over
            processes: one collective                                      (StepLoss.units)
    loss    each micro-batch's  sum_k loss_sum_k / units_k(step, all processes)  x the DDP
            factor (DDP averages gradients over its processes; FSDP2 and one process sum)
    backward on every micro-batch; DDP reduces the gradients once, at the last one
    check   the step's loss and global gradient norm finite, or NonFiniteStep with the
            gradients dropped and the weights untouched (the run decides: skip or stop)
    clip    by the norm the check computed (LAMB clips inside with it); the learning rate
            written into every group; the optimizer (through the fp16 GradScaler) steps

So 1 process x GA micro-batches and GA processes x 1 micro-batch are one computation up to
float summation order, whatever the job. A job says only what differs (`StepLoss`).

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

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from packed_transformers.components.distributed import all_reduce_
from packed_transformers.optim import AdjustedHyperparameters, adjust_for_packing
from packed_transformers.optim.lamb import Lamb, tensor_norms


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


@dataclass(frozen=True)
class StepSettings:
    """How this run's steps are taken (fixed for the run)."""

    device: torch.device
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; weights stay fp32)
    max_grad_norm: float = 0.0  # clip to this global norm (0: never); LAMB clips inside with its own
    group: object = None  # the data-parallel process group (None: every process)
    check_finite: bool = True  # False: the memory plan's step on fake tensors (no values to check)


@dataclass
class StepResult:
    """A step that passed: its units over every process (float64 [terms], host), the global
    gradient norm (None where not computed: fp16's GradScaler checks its own) and what the job
    kept of each micro-batch."""

    units: torch.Tensor
    grad_norm: torch.Tensor | None
    kept: list = field(default_factory=list)


def take_step(step_model, optimizer, micro_batches: list[dict], job: StepLoss, lr: float,
              settings: StepSettings, scaler=None) -> StepResult:  # fmt: skip
    """One optimizer step over this process's micro-batches (host tensors): see the module's
    docstring. NonFiniteStep (gradients dropped, weights untouched) for a non-finite loss or
    gradient norm. `step_model` is what runs the forward (the model, compiled, DDP or FSDP2:
    DDP averages gradients over its processes, so the loss is multiplied by their number);
    `optimizer` holds the model's parameters."""
    per_batch = [[float(u) for u in job.units(batch)] for batch in micro_batches]
    totals = units_over_processes([sum(column) for column in zip(*per_batch)], settings)
    averaged = isinstance(step_model, torch.nn.parallel.DistributedDataParallel)
    processes = torch.distributed.get_world_size(step_model.process_group) if averaged else 1
    scales = [processes / max(float(total), 1.0) for total in totals]
    step_loss = torch.zeros((), device=settings.device)
    kept = []
    for i, host_batch in enumerate(micro_batches):
        batch = {k: v.to(settings.device, non_blocking=True) for k, v in host_batch.items()}
        last = i == len(micro_batches) - 1
        sync = (
            contextlib.nullcontext() if last or not hasattr(step_model, "no_sync") else step_model.no_sync()
        )
        with sync:
            with autocast_context(settings.precision, settings.device):
                out = step_model(**batch)
            loss = sum(loss_sum * scale for loss_sum, scale in zip(job.loss_sums(out), scales))
            kept.append(job.kept(out, host_batch))
            # only the loss is kept through the backward: the outputs may hold logits the
            # backward does not need (a decoder's predicted tokens' [N, V] fp32)
            del out
            (scaler.scale(loss) if scaler is not None else loss).backward()
        step_loss = step_loss + loss.detach().float()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    fp16 = scaler is not None and scaler.is_enabled()
    try:  # fp16: the GradScaler skips steps with inf/NaN gradients by design; the loss is checked
        norm = check_finite_step(step_loss, parameters, not fp16) if settings.check_finite else None
    except NonFiniteStep:
        optimizer.zero_grad(set_to_none=True)
        raise
    set_learning_rate(optimizer, lr)
    if isinstance(optimizer, Lamb):  # LAMB clips inside, by the norm the check computed
        arguments = {"grad_norm": norm} if norm is not None else {}
    else:
        arguments = {}
        if settings.max_grad_norm > 0 and norm is not None:
            clip_to_norm_(parameters, norm, settings.max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer, **arguments)
        scaler.update()
    else:
        optimizer.step(**arguments)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(torch.tensor(totals, dtype=torch.float64), norm, kept)


def units_over_processes(local: list, settings: StepSettings) -> list:
    """Each term's units summed over the data-parallel processes (one collective), as Python
    floats; one process adds nothing, and makes no tensor (the plan's fake mode has no values)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    return all_reduce_(torch.tensor(local, dtype=torch.float64).to(settings.device), settings.group).tolist()


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
