"""Fine-tuning checkpoints: every run's format, writer and resume policy
(components.checkpoint), the latest only, its model/ in the run's own names (safetensors,
loaded strictly) and the run state (components.run_state.RunState, its extra this module's
FinetuneProgress) in training_state.pt beside AdamW's and every RNG's state. Written after
every epoch's validation and when a signal stops a run; an epoch's batch order is a pure
function of seed and epoch, so the position in it is a count of batches: a resumed run's
weights equal the unstopped run's (tests/finetune/test_finetune_resume.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from packed_transformers.components import checkpoint as ckpt
from packed_transformers.components.run_state import RunState, plain_values
from packed_transformers.finetune.job_contract import STEP_SUMS

KEEP = 1  # a fine-tuning run keeps its latest checkpoint only (as many copies of the model as before)


def zero_sums() -> dict[str, float]:
    return dict.fromkeys(STEP_SUMS, 0.0)


@dataclass
class FinetuneProgress:
    """Fine-tuning's part of the run state (components.run_state.RunState.extra; its `samples`
    are the examples trained, its `train_seconds` the optimizer steps' time). config: the run's
    (resolved); data_sha256: input_digest's. epoch: the epoch in progress (the next to run once
    one is validated); batches_done: batches of it trained; sums: its running STEP_SUMS.
    padding: each epoch's padding fraction. finished: the last epoch (or a time budget's stop)
    is validated and checkpointed."""

    config: dict | None = None
    data_sha256: dict = field(default_factory=dict)
    epoch: int = 0
    batches_done: int = 0
    sums: dict = field(default_factory=zero_sums)
    padding: list = field(default_factory=list)
    finished: bool = False

    @classmethod
    def from_dict(cls, values: dict) -> FinetuneProgress:
        return cls(**plain_values(cls, values))


def checkpoints_folder(output: Path) -> Path:
    return Path(output) / "checkpoints"


def has_checkpoint(output: Path) -> bool:
    """Whether OUTPUT holds any checkpoint folder (intact or not)."""
    return bool(ckpt.list_checkpoints(checkpoints_folder(output)))


@dataclass
class Resumable:
    """The checkpoint a --resume continues from, read once (components.checkpoint.resume_points):
    its run state, compared with the config before anything is built, and the checkpoints to
    restore from in order, it first."""

    progress: RunState
    points: Iterator[tuple[Path, dict]]


def resume_point(output: Path) -> Resumable | None:
    """The newest intact checkpoint, read; None without one. ckpt.CheckpointError where there
    are checkpoints and none intact, or its state is not plain values."""
    if not has_checkpoint(output):
        return None
    points = ckpt.resume_points(checkpoints_folder(output))
    newest = next(points, None)
    if newest is None:
        raise ckpt.CheckpointError(f"{checkpoints_folder(output)} holds no intact checkpoint")
    path, state = newest
    progress = RunState.from_saved(state, FinetuneProgress, path / "training_state.pt")
    return Resumable(progress, itertools.chain([newest], points))


def read_progress(output: Path) -> RunState | None:
    """The newest intact checkpoint's run state (resume_point's); None without one."""
    return getattr(resume_point(output), "progress", None)
