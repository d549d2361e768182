"""What a run asks of an engine: the `Engine` interface, and what every engine's step answers.

An engine owns the model's placement, the optimizer and how one host call turns
micro-batches into optimizer steps: `step(micro_batches, loss, lr)`, the job's loss a
components.step.StepLoss, the answer a `StepResult`. The run owns everything else (data
order, the evaluation schedule, checkpoints, logging, stopping) and calls nothing else.
Engines never import the run, and every engine computes its loss with components.step. The
torch engine steps every job's loss; the pipeline and IPU engines stage BERT's per-token
`PretrainingLoss` alone (their last stage, their graph, compute it), and refuse any other
config at `check_config` in one line (the decoder's and fine-tuning's name neither).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from packed_transformers.components.checkpoint import weights_writer
from packed_transformers.components.errors import RunError
from packed_transformers.components.observe import MetricSums, sums_vector
from packed_transformers.components.step import BatchArithmetic, StepLoss, batch_counts


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


@dataclass
class StepResult:
    """A call that passed: its units over every process (float64 [terms], host; an IPU call's
    summed over its steps), the global gradient norm (None where not computed: fp16's
    GradScaler checks its own; the pipeline and IPU engines) and what the job's loss kept of
    each micro-batch (an engine that sums on its device: one item for the call)."""

    units: torch.Tensor
    grad_norm: torch.Tensor | None
    kept: list = field(default_factory=list)


@dataclass(frozen=True)
class PretrainingLoss:
    """BERT's MLM + NSP loss, every engine's: masked tokens (or, per_sequence, sequences with a
    masked token) and sequences as the two terms' units; each micro-batch's metric sums and
    real tokens kept for the logging window (a SUM_KEYS vector: components.observe.sums_vector)."""

    mlm_loss_mode: str  # model.mlm_loss_mode: per_token | per_sequence

    def units(self, batch: dict) -> tuple[float, float]:
        return batch_counts(batch, self.mlm_loss_mode)

    def loss_sums(self, out: dict):
        loss_key = "mlm_sequence_loss_sum" if self.mlm_loss_mode == "per_sequence" else "mlm_loss_sum"
        return out[loss_key], out["nsp_loss_sum"]

    def kept(self, out: dict, batch: dict) -> torch.Tensor:
        return sums_vector(out, int((batch["sequence_ids"] > 0).sum()))  # host token count: no sync


PER_TOKEN = PretrainingLoss("per_token")


def staged_loss_only(engine: str, loss: StepLoss) -> None:
    """The pipeline's and the IPU's step: they stage BERT's per-token loss alone (check_config
    refused every other config; this names a caller that hands another loss)."""
    if loss != PER_TOKEN:
        raise RunError(f"the {engine} engine stages BERT's per-token pretraining loss alone, not {loss!r}")


class Engine(Protocol):
    rank: int  # this process; rank 0 writes logs and checkpoints
    data_rank: int  # which share of the data this process reads ...
    data_world: int  # ... out of how many shares
    micro_batches_per_call: int  # micro-batches this process feeds to one `step` call
    steps_per_call: int  # optimizer steps one `step` call makes

    @staticmethod
    def check_config(config: dict) -> None:
        """Every refusal of this engine that the config alone decides (RunError naming the
        key); the run calls it before any data is opened or hashed and the model built."""

    def __init__(self, config: dict): ...

    def attach(self, model, packing_factor: float) -> BatchArithmetic:
        """Place the model, build the optimizer; the step's batch arithmetic."""

    def step(self, micro_batches: list[dict], loss: StepLoss, lr: float) -> StepResult:
        """`steps_per_call` optimizer steps of the job's `loss` over this process's micro-batches
        (`micro_batches_per_call` of them); NonFiniteStep for one refused (weights untouched)."""

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
