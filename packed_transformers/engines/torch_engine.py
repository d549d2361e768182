"""The torch engine (CPU, CUDA; DDP or FSDP2 under torchrun): every job's step, and BERT's
`Engine` over it.

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

`TorchStep` holds what a job's steps are taken with (the weights, the optimizer, what runs the
forward: the model, compiled, DDP; the settings), gives a checkpoint its parts (a sharded run's,
every job's alike: DCP shards of model and optimizer, the weights gathered whole for model/) and
restores any checkpoint on any number of ranks, sharded or not. A job says only its loss (components.step.StepLoss):
BERT's is `PretrainingLoss`, masked tokens and sequences its units. `TorchEngine` is every job's
engine over a TorchStep: BERT's (training.run's `Engine`, with LAMB, through `attach`), the
decoder's and fine-tuning's (`place`, with their AdamW).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import torch

from packed_transformers.components.distributed import (
    ONE_PROCESS,
    all_reduce_,
    data_parallel,
    max_over_processes,
    setup_replica,
)
from packed_transformers.components.observe import MetricSums, summarize
from packed_transformers.components.sharding import with_spare_forwards
from packed_transformers.components.step import (
    BatchArithmetic,
    NonFiniteStep,
    StepLoss,
    set_learning_rate,
)
from packed_transformers.engines.engine import Snapshot, StepResult
from packed_transformers.optim import build_lamb
from packed_transformers.optim.lamb import Lamb, local_part, tensor_norms

log = logging.getLogger("training")


# --------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepSettings:
    """How this run's steps are taken (fixed for the run)."""

    device: torch.device
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; weights stay fp32)
    max_grad_norm: float = 0.0  # clip to this global norm (0: never); LAMB clips inside with its own
    group: object = None  # the data-parallel process group (None: every process)
    check_finite: bool = True  # False: the memory plan's step on fake tensors (no values to check)


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


def clip_to_norm_(parameters, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) in place: clipping by a global
    norm already computed (check_finite_step's), so the gradients are read once. Under FSDP2
    each process scales its own shards (the norm is every process's)."""
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([local_part(p.grad) for p in parameters if p.grad is not None], coefficient)


# What a compiled training step hands torch.compile (tests count compilations through another backend).
COMPILE_BACKEND = "inductor"


def forward_of(model: torch.nn.Module, replicas, precision: str, compile_step: bool, blocks=None,
               backend: str | None = None, dynamic: bool | None = False) -> tuple[torch.nn.Module, int]:  # fmt: skip
    """What runs a job's forward, one policy for every job on torch (BERT's engine, the decoder,
    fine-tuning). Sharded (FSDP2): each block (`blocks`; default components.sharding's
    block_modules) and then the model sharded in place, gradients summed over ranks, a block's
    other entry points (its `forward_*` methods: a packed encoder's last layer) registered; then
    the model compiled where asked (torch.compile with `backend`, default COMPILE_BACKEND, static
    shapes unless `dynamic`);
    replicated over more than one process, DDP around it (it averages gradients: take_step
    multiplies its loss back). -> (the module a step calls, the blocks sharded: 0 unsharded)."""
    from packed_transformers.components.sharding import block_modules, shard_model

    sharded_blocks = 0
    if replicas.sharded:
        from torch.distributed.fsdp import register_fsdp_forward_method

        blocks = block_modules(model, "execution.sharding") if blocks is None else list(blocks)
        sharded_blocks = shard_model(model, replicas.world, precision, replicas.device, blocks=blocks)
        for block in blocks:
            for name in (n for n in dir(block) if n.startswith("forward_") and callable(getattr(block, n))):
                register_fsdp_forward_method(block, name)
    step_model = (
        torch.compile(model, backend=backend or COMPILE_BACKEND, dynamic=dynamic) if compile_step else model
    )
    if replicas.world > 1 and not replicas.sharded:
        step_model = data_parallel(step_model, replicas.device)
    return step_model, sharded_blocks


def autocast_context(precision: str, device: torch.device):
    """torch.autocast for bf16/fp16 (weights stay fp32); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class TorchStep:
    """One job's steps on torch: the only caller of take_step in a run."""

    model: torch.nn.Module  # the weights (sharded in place under FSDP2)
    optimizer: torch.optim.Optimizer  # holds the model's parameters
    step_model: torch.nn.Module  # what runs the forward: the model, compiled, DDP
    settings: StepSettings  # device, precision, clipping, the data-parallel group
    sharded: bool = False  # FSDP2: the optimizer state is gathered whole to save, scattered to load
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler (None: no scaling)

    def step(self, micro_batches: list[dict], loss: StepLoss, lr: float) -> StepResult:
        """One optimizer step over this process's micro-batches (host tensors); NonFiniteStep
        (gradients dropped, weights untouched) for a non-finite one."""
        self.model.train()
        return take_step(self.step_model, self.optimizer, micro_batches, loss, lr, self.settings, self.scaler)

    def engine_state(self) -> dict:
        """An unsharded step's entries of training_state.pt: {"optimizer", "scaler": fp16's}
        (a sharded step's optimizer goes to dcp/: snapshot)."""
        state = {"optimizer": self.optimizer.state_dict()}
        return state if self.scaler is None else {**state, "scaler": self.scaler.state_dict()}

    def snapshot(self, weights_of: torch.nn.Module | None = None, save_whole=None) -> Snapshot:
        """This step's Snapshot for the one checkpoint writer, the one sharded policy of every
        job (collective where sharded); model/ written by rank 0 alone. Unsharded: the model
        saved as it is (`save_whole`, None: its save_pretrained) and the optimizer whole in
        training_state.pt. Sharded: the weights gathered whole on rank 0's CPU for model/ (a
        tied tensor once), and every rank's shards of the model and the optimizer written to dcp/
        (no rank holds the optimizer whole). weights_of: as `restore`'s."""
        weights_of = self.model if weights_of is None else weights_of
        weights, write_shards = None, None
        if not self.sharded:
            engine_state = self.engine_state()
        else:
            from packed_transformers.components.replicas import gathered_weights
            from packed_transformers.components.sharding import shards_writer

            this_rank = replace(ONE_PROCESS, rank=torch.distributed.get_rank(), sharding="fsdp")
            weights = gathered_weights(weights_of, this_rank)  # rank 0's; None on the others
            write_shards = shards_writer(weights_of, self.optimizer)
            engine_state = None if self.scaler is None else {"scaler": self.scaler.state_dict()}
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return Snapshot(None, None, write_shards=write_shards)
        return Snapshot(weights_of, engine_state, weights, write_shards, save_whole)

    def restore(self, path, engine_state: dict, weights_of: torch.nn.Module | None = None) -> None:
        """A checkpoint's weights and optimizer state into this step, whoever wrote it and on any
        number of ranks, sharded or not: a sharded run's dcp/ read resharded, or model/ and
        training_state.pt's optimizer (gathered whole; each rank takes its shards). weights_of:
        the module whose names the checkpoint keeps (default the model; a decoder's transformers
        model)."""
        from packed_transformers.components.run_checkpoint import load_model_weights
        from packed_transformers.components.sharding import has_shards

        weights_of = self.model if weights_of is None else weights_of
        if not has_shards(path):  # dcp/ holds the weights too: load_state reads them there
            sharding = "fsdp" if self.sharded else "none"
            load_model_weights(weights_of, path, replace(ONE_PROCESS, sharding=sharding))
        self.load_state(engine_state, path, weights_of)

    def load_state(self, engine_state: dict, path=None, weights_of: torch.nn.Module | None = None) -> None:
        """The optimizer's state (and fp16's scaler's), whoever wrote it (one process, DDP or
        FSDP2 ranks): from the checkpoint's dcp/ at `path` where a sharded run wrote one (read
        resharded, with the weights of `weights_of`, default the model), else engine_state's
        whole state (each rank taking its shards where sharded)."""
        from packed_transformers.components.sharding import (
            has_shards,
            load_full_optimizer_state,
            load_sharded,
        )

        if path is not None and has_shards(path):
            load_sharded(path, self.model if weights_of is None else weights_of, self.optimizer)
        elif self.sharded:
            load_full_optimizer_state(self.optimizer, engine_state["optimizer"])
        else:
            self.optimizer.load_state_dict(engine_state["optimizer"])
        if self.scaler is not None and "scaler" in engine_state:
            self.scaler.load_state_dict(engine_state["scaler"])


def evaluation_outputs(model, items: list, fetch, most: int, spare, device, precision: str):
    """Every job's evaluation forwards: (outputs, host batch) for each of this rank's `items`
    (fetch(item) -> its host batch), the model in eval mode without gradients, under the run's
    autocast; then forwards of `spare` whose outputs are dropped, up to `most` in all (a sharded
    model's ranks run equally many forwards: components.sharding.with_spare_forwards). The
    model's mode is put back."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for item, counted in with_spare_forwards(list(items), most, spare):
                host_batch = fetch(item)
                batch = {k: v.to(device) for k, v in host_batch.items()}
                with autocast_context(precision, device):
                    out = model(**batch)
                if counted:
                    yield out, host_batch
    finally:
        model.train(was_training)


def evaluate(model, shards, batches, device, precision, spare_forwards: int = 0) -> dict:
    """Exact eval metrics (token and sequence counts) over this replica's batches, all-reduced.
    spare_forwards: forwards of the first batch (or of the first evaluation batch) whose outputs
    count for nothing (a sharded model's ranks run equally many forwards)."""
    sums = MetricSums()
    spare = batches[0] if len(batches) else [0]
    for out, host_batch in evaluation_outputs(model, batches, shards.__getitem__, len(batches) + spare_forwards,
                                              spare, device, precision):  # fmt: skip
        sums.add(out, int((host_batch["sequence_ids"] > 0).sum()))
    return summarize(sums.reduce())


class TorchEngine:
    """engines.engine.Engine for torch on CPU/CUDA, with DDP or FSDP2 under torchrun: every job's
    engine (BERT's through `attach`; the decoder and fine-tuning `place` their model with their
    own optimizer). Its step, checkpoint parts and restore are its TorchStep's."""

    steps_per_call = 1

    @staticmethod
    def check_config(config: dict) -> None:
        """Nothing beyond the config's own checks (precision and device, compile-only)."""

    def __init__(self, config: dict, replicas=None):
        """replicas: this process among the run's (components.distributed.Replicas; default
        from torchrun's environment and the config's execution section)."""
        self.config = config
        self.replica = setup_replica(config) if replicas is None else replicas
        self.rank = self.data_rank = self.replica.rank
        self.data_world = self.replica.world

    def place(self, model, optimizer_of, precision: str = "fp32", compile_step: bool = False,
              max_grad_norm: float = 0.0, scaler=None, **forward) -> int:  # fmt: skip
        """Every job's: the model's forward (forward_of: sharded per block, compiled, DDP; `forward`
        its blocks, backend, dynamic), then the optimizer optimizer_of(model) builds over the placed
        parameters, the step clipping at max_grad_norm (0: never; LAMB clips inside). -> the number
        of blocks sharded (0 unsharded)."""
        step_model, blocks = forward_of(model, self.replica, precision, compile_step, **forward)
        settings = StepSettings(self.replica.device, precision, max_grad_norm)
        self.torch_step = TorchStep(
            model, optimizer_of(model), step_model, settings, self.replica.sharded, scaler
        )
        return blocks

    @property
    def model(self) -> torch.nn.Module:
        return self.torch_step.model

    @property
    def step_model(self) -> torch.nn.Module:
        return self.torch_step.step_model

    def step(self, micro_batches: list[dict], loss: StepLoss, lr: float) -> StepResult:
        """Every job's optimizer step (TorchStep.step)."""
        return self.torch_step.step(micro_batches, loss, lr)

    def attach(self, model, packing_factor: float) -> BatchArithmetic:
        """BERT's: the model placed with LAMB (its betas after the packing adjustment) and fp16's
        loss scaler; the step's batch arithmetic."""
        training, optim = self.config["training"], self.config["optim"]
        batch = BatchArithmetic.from_config(self.config, packing_factor, self.replica.world)
        sharded = self.replica.sharded
        self.micro_batches_per_call = batch.gradient_accumulation
        model.to(self.replica.device)
        model.train()
        if sharded:  # what save_pretrained writes unsharded
            model.config.architectures = [type(model).__name__]
        # FSDP2: each encoder layer, then the model (the embeddings, heads and the tied MLM decoder
        # together); LAMB over the shards (its norms over whole tensors)
        scaler = torch.amp.GradScaler(self.replica.device.type, enabled=training["precision"] == "fp16")
        blocks = self.place(model, lambda placed: build_lamb(placed, optim, batch.betas, optim["max_grad_norm"]),
                            training["precision"], training["compile"] and not sharded, scaler=scaler,
                            blocks=model.encoder_layers, dynamic=None)  # fmt: skip
        if sharded and self.rank == 0:
            log.info(
                "FSDP2: %d encoder layers and the model sharded over %d ranks", blocks, self.replica.world
            )
        return batch

    def evaluate(self, shards, batches) -> dict:
        # sharded, every forward gathers parameters collectively: every rank runs as many as the
        # rank with the most batches, a shorter one repeating its first without counting it
        spare = max_over_processes(len(batches)) - len(batches) if self.torch_step.sharded else 0
        return evaluate(self.torch_step.model, shards, batches, self.replica.device,
                        self.config["training"]["precision"], spare_forwards=spare)  # fmt: skip

    def reduce(self, sums: MetricSums) -> dict:
        return sums.reduce()

    def snapshot(self, weights_of=None, save_whole=None) -> Snapshot:
        """Collective under FSDP2: every rank's shards of the weights and the optimizer's state
        for dcp/ and the weights gathered whole for model/; unsharded, every replica holds the
        same weights. Rank 0 writes model/ (TorchStep.snapshot: weights_of, save_whole)."""
        return self.torch_step.snapshot(weights_of, save_whole)

    def restore(self, path, engine_state: dict, weights_of=None) -> None:
        """A checkpoint's weights and optimizer state, on any number of ranks, sharded or not
        (TorchStep.restore; the decoder's and fine-tuning's resume)."""
        self.torch_step.restore(path, engine_state, weights_of)

    def load_state(self, engine_state: dict, path=None) -> None:
        """The optimizer's (and fp16's scaler's) state, a sharded run's from dcp/ at `path`
        (TorchStep.load_state; BERT's weights came from model/ before `attach`)."""
        self.torch_step.load_state(engine_state, path)
