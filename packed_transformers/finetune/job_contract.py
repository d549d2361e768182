"""What a fine-tuning task gives the shared loop (finetune.train), as one `Job`, and how a
config names the demo assets. Each task's module builds its Job (finetune.jobs,
finetune.causal_lm_task); the loop reads only this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from packed_transformers.components.batches import collate
from packed_transformers.components.step import MeanLoss
from packed_transformers.door.loaded import LoadedModel

STEP_SUMS = ("loss_sum", "count", "correct", "correct_count")  # what a training step adds up


def classification_sums(out: dict, batch: dict | None = None) -> dict:
    """A packed head's outputs -> the step's sums (STEP_SUMS): its loss over `count` examples
    and `correct` of `correct_count` predictions (the batch is not needed)."""
    return {key: float(out[key]) for key in STEP_SUMS}


def present_examples(batch: dict) -> tuple[int]:
    """A packed head's units: the examples in its slots (example_index >= 0)."""
    return (int((batch["example_index"] >= 0).sum()),)


# The step's loss (engines.torch_engine.take_step) of a packed head (classification, QA, tokens) and
# of contrastive training (the step's anchors, each scored against every process's candidates).
SLOT_LOSS = MeanLoss(present_examples, "count", classification_sums)
ANCHOR_LOSS = MeanLoss(lambda batch: (int(batch["anchor_slots"].numel()),), "count", classification_sums)


@dataclass
class Job:
    """What the shared loop needs from a task: the training and validation rows (anything
    with token_ids, segment_ids, labels and lengths), the starting checkpoint as the door
    opened it (one LoadedModel: the model, its length limit and the tokenizer the rows were
    made with), and how to evaluate, write and save; how a batch table becomes model inputs
    and a step's outputs its sums."""

    train: object
    validation: object
    opened: LoadedModel
    evaluate: Callable  # (model, eval batcher) -> (metrics dict, inference timing, outputs)
    write_outputs: Callable  # (output folder, outputs) -> None
    save: Callable  # (model, model folder) -> None
    description: str  # "5 classes" / "1,203 questions"
    collate: Callable = collate  # (rows, batch table [B, K], width) -> model inputs
    loss: MeanLoss = SLOT_LOSS  # the step's loss: its units, its sum, the STEP_SUMS kept
    # (an epoch's tables) -> the padding its steps compute on; None: the batcher's figure (the
    # contrastive job packs each step)
    padding: Callable | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.opened.model


@dataclass(frozen=True)
class JobInput:
    """A task's input, read and checked (a finetune.specs reader's answer): its rows, how they are
    batched ((config, batch size) -> BatchingSpec; None: the config's batching), and `build`,
    which opens the model and returns the Job once the whole input is read and batched."""

    train: object
    validation: object
    build: Callable[[], Job]
    batching: Callable | None = None
