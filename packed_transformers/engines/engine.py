"""What the run (training.run) asks of a backend: the `Engine` interface.

An engine owns the model's placement, the optimizer and how one host call turns
micro-batches into optimizer steps. The run owns everything else (data order, the
evaluation schedule, checkpoints, logging, stopping) and calls nothing else. Engines
never import the run, and every engine computes its loss with components.step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from packed_transformers.components.checkpoint import weights_writer
from packed_transformers.components.observe import MetricSums
from packed_transformers.components.step import BatchArithmetic


@dataclass(frozen=True)
class Snapshot:
    """What a checkpoint needs from an engine (every job's: components.run_checkpoint.
    write_checkpoint takes it), taken together so that the weights and the optimizer state are of
    the same step. On ranks that do not write: model and state None."""

    model: Any  # the model whose names and config model/ keeps (BERT's: every stage's weights)
    engine_state: dict | None  # {"optimizer": ..., optionally "scaler": ...}; sharded: no optimizer
    weights: dict | None = None  # a sharded model's weights gathered whole (`model` then gives its config)
    write_shards: Any = None  # a sharded run's writer of dcp/, every rank's (its optimizer is there)
    save_whole: Any = None  # unsharded: model/'s writer (None: the model's save_pretrained)

    def model_writer(self):
        """model/'s writer (folder -> None) on the rank that writes it, None on the others: the
        weights gathered whole under the model's names where sharded, else `save_whole`."""
        if self.model is None:
            return None
        if self.weights is not None:
            return weights_writer(self.model, self.weights)
        return self.save_whole or self.model.save_pretrained


class Engine(Protocol):
    rank: int  # this process; rank 0 writes logs and checkpoints
    data_rank: int  # which share of the data this process reads ...
    data_world: int  # ... out of how many shares
    micro_batches_per_call: int  # micro-batches this process feeds to one `train` call
    steps_per_call: int  # optimizer steps one `train` call makes

    @staticmethod
    def check_config(config: dict) -> None:
        """Every refusal of this engine that the config alone decides (RunError naming the
        key); the run calls it before any data is opened or hashed and the model built."""

    def __init__(self, config: dict): ...

    def attach(self, model, packing_factor: float) -> BatchArithmetic:
        """Place the model, build the optimizer; the step's batch arithmetic."""

    def train(self, micro_batches: list[dict], lr: float, sums: MetricSums) -> torch.Tensor:
        """`steps_per_call` optimizer steps; adds the metric sums; returns the call's global
        [masked tokens, sequences] (float64, host)."""

    def evaluate(self, shards, batches: list[list[int]]) -> dict:
        """Exact evaluation metrics (components.observe.summarize) over every replica's batches."""

    def reduce(self, sums: MetricSums) -> dict:
        """Metric sums of every replica."""

    def snapshot(self) -> Snapshot:
        """Collective: the whole model and the optimizer state, on rank 0."""

    def load_state(self, engine_state: dict, path=None) -> None:
        """Restore what `snapshot()` kept (after `attach`): engine_state, and the checkpoint's
        dcp/ at `path` where a sharded run wrote one (an engine that cannot read it refuses in
        one line, RunError)."""
