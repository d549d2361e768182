"""The torch engine (CPU, CUDA; DDP or FSDP2 under torchrun): every job's step, and BERT's
`Engine` over it.

`TorchStep` is what every job on torch runs its steps through (BERT pretraining here, the
decoder's run, every fine-tuning task): the weights, the optimizer, what runs the forward (the
model, compiled, DDP) and how steps are taken; its step is components.step.take_step, its
optimizer state one format whoever wrote it (gathered whole under FSDP2). A job says only its
loss (a components.step.StepLoss): BERT's is `PretrainingLoss` (masked tokens and sequences its
units, counted on the host over all replicas before compute); DDP all-reduces the gradients
once, on the last micro-batch; LAMB steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from packed_transformers.components.distributed import data_parallel, max_over_processes, setup_replica
from packed_transformers.components.observe import SUM_KEYS, MetricSums, summarize
from packed_transformers.components.step import (
    BatchArithmetic,
    StepLoss,
    StepResult,
    StepSettings,
    autocast_context,
    batch_counts,
    take_step,
)
from packed_transformers.engines.engine import Snapshot
from packed_transformers.optim import build_lamb

log = logging.getLogger("training")


@dataclass
class TorchStep:
    """One job's steps on torch: the only caller of components.step.take_step in a run."""

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
        """Collective under FSDP2: {"optimizer": its state whole, "scaler": fp16's scaler's}."""
        if self.sharded:
            from packed_transformers.components.sharding import full_optimizer_state

            state = {"optimizer": full_optimizer_state(self.optimizer)}
        else:
            state = {"optimizer": self.optimizer.state_dict()}
        return state if self.scaler is None else {**state, "scaler": self.scaler.state_dict()}

    def load_state(self, engine_state: dict) -> None:
        """What engine_state() held, whoever wrote it (one process, DDP or FSDP2 ranks)."""
        if self.sharded:
            from packed_transformers.components.sharding import load_full_optimizer_state

            load_full_optimizer_state(self.optimizer, engine_state["optimizer"])
        else:
            self.optimizer.load_state_dict(engine_state["optimizer"])
        if self.scaler is not None and "scaler" in engine_state:
            self.scaler.load_state_dict(engine_state["scaler"])


@dataclass(frozen=True)
class PretrainingLoss:
    """BERT's MLM + NSP loss for components.step.take_step: masked tokens (or, per_sequence,
    sequences with a masked token) and sequences as the two terms' units; each micro-batch's
    metric sums and real tokens kept for the logging window."""

    mlm_loss_mode: str  # model.mlm_loss_mode: per_token | per_sequence

    def units(self, batch: dict) -> tuple[float, float]:
        return batch_counts(batch, self.mlm_loss_mode)

    def loss_sums(self, out: dict):
        loss_key = "mlm_sequence_loss_sum" if self.mlm_loss_mode == "per_sequence" else "mlm_loss_sum"
        return out[loss_key], out["nsp_loss_sum"]

    def kept(self, out: dict, batch: dict):
        return {k: out[k].detach() for k in SUM_KEYS[:-1]}, int((batch["sequence_ids"] > 0).sum())


def train_step(torch_step: TorchStep, micro_batches: list[dict], mode: str, lr: float, sums: MetricSums):
    """One optimizer step of BERT's loss (mode: model.mlm_loss_mode) over this replica's
    micro-batches. Returns the step's global counts [masked tokens, sequences]; adds the
    step's metric sums once it passed."""
    result = torch_step.step(micro_batches, PretrainingLoss(mode), lr)
    for model_sums, tokens in result.kept:
        sums.add(model_sums, tokens)  # host token count: no device sync
    return result.units


@torch.no_grad()
def evaluate(model, shards, batches, device, precision, spare_forwards: int = 0) -> dict:
    """Exact eval metrics (token and sequence counts) over this replica's batches, all-reduced.
    spare_forwards: forwards of the first batch (or of the first evaluation batch) whose outputs
    count for nothing (a sharded model's ranks run equally many forwards)."""
    was_training = model.training
    model.eval()
    sums = MetricSums()
    for packs in batches:
        host_batch = shards[packs]
        batch = {k: v.to(device) for k, v in host_batch.items()}
        with autocast_context(precision, device):
            out = model(**batch)
        sums.add(out, int((host_batch["sequence_ids"] > 0).sum()))
    for _ in range(spare_forwards):
        spare = {k: v.to(device) for k, v in shards[batches[0] if batches else [0]].items()}
        with autocast_context(precision, device):
            model(**spare)
    model.train(was_training)
    return summarize(sums.reduce())


class TorchEngine:
    """engines.engine.Engine for torch on CPU/CUDA, with DDP under torchrun."""

    steps_per_call = 1

    @staticmethod
    def check_config(config: dict) -> None:
        """Nothing beyond training.config's own checks (precision and device, compile-only)."""

    def __init__(self, config: dict):
        self.config = config
        self.replica = setup_replica(config)
        self.rank = self.data_rank = self.replica.rank
        self.data_world = self.replica.world

    def attach(self, model, packing_factor: float) -> BatchArithmetic:
        training, optim = self.config["training"], self.config["optim"]
        batch = BatchArithmetic.from_config(self.config, packing_factor, self.replica.world)
        self.model = model
        self.sharded = self.config["execution"]["sharding"] == "fsdp"
        self.micro_batches_per_call = batch.gradient_accumulation
        model.to(self.replica.device)
        model.train()
        step_model = model
        if self.sharded:
            # FSDP2: each encoder layer, then the model (the embeddings, heads and the tied MLM
            # decoder together); LAMB over the shards (its norms over whole tensors). Gradients
            # are summed over ranks, not averaged: the step's loss scaling needs no `* world`.
            from packed_transformers.components.sharding import shard_model

            model.config.architectures = [type(model).__name__]  # what save_pretrained writes unsharded
            blocks = shard_model(model, self.replica.world, training["precision"], self.replica.device,
                                 blocks=model.encoder_layers)  # fmt: skip
            if self.rank == 0:
                log.info(
                    "FSDP2: %d encoder layers and the model sharded over %d ranks", blocks, self.replica.world
                )
        else:
            step_model = torch.compile(model) if training["compile"] else model
            if self.replica.world > 1:
                step_model = data_parallel(step_model, self.replica.device)
        self.torch_step = TorchStep(
            model, build_lamb(model, optim, batch.betas, optim["max_grad_norm"]), step_model,
            StepSettings(self.replica.device, training["precision"]), self.sharded,
            torch.amp.GradScaler(self.replica.device.type, enabled=training["precision"] == "fp16"),
        )  # fmt: skip
        return batch

    def train(self, micro_batches, lr, sums: MetricSums) -> torch.Tensor:
        return train_step(self.torch_step, micro_batches, self.config["model"]["mlm_loss_mode"], lr, sums)

    def evaluate(self, shards, batches) -> dict:
        if self.sharded:
            # every forward gathers parameters collectively: every rank runs as many as the
            # rank with the most batches, a shorter one repeating its first without counting it
            most = max_over_processes(len(batches))
            return evaluate(self.model, shards, batches, self.replica.device, self.config["training"]["precision"],
                            spare_forwards=most - len(batches))  # fmt: skip
        return evaluate(
            self.model, shards, batches, self.replica.device, self.config["training"]["precision"]
        )

    def reduce(self, sums: MetricSums) -> dict:
        return sums.reduce()

    def snapshot(self) -> Snapshot:
        """Collective under FSDP2: the weights and the optimizer state gathered whole; every
        replica of an unsharded run holds the same weights. Rank 0 writes."""
        weights = None
        if self.sharded:
            from packed_transformers.components.replicas import Replicas, gathered_weights

            weights = gathered_weights(
                self.model, Replicas(self.rank, self.replica.world, self.replica.device, "fsdp")
            )
        engine_state = self.torch_step.engine_state()
        return Snapshot(self.model, engine_state, weights) if self.rank == 0 else Snapshot(None, None)

    def load_state(self, engine_state: dict) -> None:
        self.torch_step.load_state(engine_state)
