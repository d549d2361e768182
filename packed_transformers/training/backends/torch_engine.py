"""The torch engine: one process = one data-parallel replica (CPU, CUDA; DDP under torchrun).

A step is components.step.take_step with BERT's loss (`PretrainingLoss`: masked tokens and
sequences its units, counted on the host over all replicas before compute); DDP
all-reduces the gradients once, on the last micro-batch; LAMB steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from packed_transformers.components.distributed import data_parallel, max_over_processes, setup_replica
from packed_transformers.components.observe import SUM_KEYS, MetricSums, summarize
from packed_transformers.components.step import (
    BatchArithmetic,
    StepSettings,
    autocast_context,
    batch_counts,
    take_step,
)
from packed_transformers.training.backends.engine import Snapshot
from packed_transformers.training.build import build_lamb

log = logging.getLogger("training")


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


def train_step(model, optimizer, scaler, micro_batches, lr, precision, device, mode, sums: MetricSums):
    """One optimizer step over this replica's micro-batches (components.step.take_step).
    world: DDP's processes (1 alone and under FSDP2, which sums). Returns the step's global
    counts [masked tokens, sequences]; adds the step's metric sums once it passed."""
    settings = StepSettings(device, precision)
    result = take_step(model, optimizer, micro_batches, PretrainingLoss(mode), lr, settings, scaler)
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
    """training.backends.engine.Engine for torch on CPU/CUDA, with DDP under torchrun."""

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
        training = self.config["training"]
        batch = BatchArithmetic.from_config(self.config, packing_factor, self.replica.world)
        self.model = model
        self.sharded = self.config["execution"]["sharding"] == "fsdp"
        self.micro_batches_per_call = batch.gradient_accumulation
        model.to(self.replica.device)
        model.train()
        self.scaler = torch.amp.GradScaler(self.replica.device.type, enabled=training["precision"] == "fp16")
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
            self.optimizer = build_lamb(model, self.config, batch, self.config["optim"]["max_grad_norm"])
            self.step_model = model
            return batch
        self.optimizer = build_lamb(model, self.config, batch, self.config["optim"]["max_grad_norm"])
        self.step_model = torch.compile(model) if training["compile"] else model
        if self.replica.world > 1:
            self.step_model = data_parallel(self.step_model, self.replica.device)
        return batch

    def train(self, micro_batches, lr, sums: MetricSums) -> torch.Tensor:
        return train_step(
            self.step_model,
            self.optimizer,
            self.scaler,
            micro_batches,
            lr,
            self.config["training"]["precision"],
            self.replica.device,
            self.config["model"]["mlm_loss_mode"],
            sums,
        )

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
        if self.sharded:  # collective: the weights and the optimizer state gathered whole
            from packed_transformers.components.replicas import Replicas, gathered_weights
            from packed_transformers.components.sharding import full_optimizer_state

            replicas = Replicas(self.rank, self.replica.world, self.replica.device, "fsdp")
            weights, optimizer = gathered_weights(self.model, replicas), full_optimizer_state(self.optimizer)
            if self.rank != 0:
                return Snapshot(None, None)
            return Snapshot(self.model, {"optimizer": optimizer, "scaler": self.scaler.state_dict()}, weights)
        # Every replica holds the same weights; rank 0 writes.
        state = {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}
        return Snapshot(self.model, state)

    def load_state(self, engine_state: dict) -> None:
        if self.sharded:  # the checkpoint holds the unsharded format, whoever wrote it
            from packed_transformers.components.sharding import load_full_optimizer_state

            load_full_optimizer_state(self.optimizer, engine_state["optimizer"])
            return
        self.optimizer.load_state_dict(engine_state["optimizer"])
        if "scaler" in engine_state:
            self.scaler.load_state_dict(engine_state["scaler"])
