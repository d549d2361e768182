"""Where a fine-tuning run stands: what a checkpoint's progress.json holds (finetune.checkpoint)
and what the summary is made from. One typed record, written and read by name."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from finetune.job_contract import STEP_SUMS


def zero_sums() -> dict[str, float]:
    return dict.fromkeys(STEP_SUMS, 0.0)


@dataclass
class RunState:
    """config: the run's config (resolved); data_sha256: {"train_file" | "validation_file": hex}
    of the data it trains on (finetune.run_folder.input_digest).
    epoch: the epoch in progress (the next to run once one is validated); batches_done: batches
    of it trained; sums: its running STEP_SUMS. steps, train_seconds (optimizer steps only),
    train_examples: the whole run's. padding: each epoch's padding fraction. finished: the
    last epoch (or a time budget's stop) is validated and checkpointed."""

    config: dict
    data_sha256: dict
    epoch: int = 0
    batches_done: int = 0
    sums: dict = field(default_factory=zero_sums)
    steps: int = 0
    train_seconds: float = 0.0
    train_examples: int = 0
    padding: list = field(default_factory=list)
    finished: bool = False

    def progress(self, **changes) -> dict:
        """The JSON object a checkpoint keeps (progress.json), with `changes` applied."""
        return {**asdict(self), **changes}

    @classmethod
    def from_progress(cls, progress: dict, config: dict, data_sha256: dict) -> RunState:
        """A checkpoint's progress -> the state, `config` replacing its config (the same but
        for the settings a resume may change); a checkpoint written before data_sha256 was
        kept takes today's digest."""
        known = {f.name for f in fields(cls)}
        kept = {key: value for key, value in progress.items() if key in known}
        kept.setdefault("data_sha256", data_sha256)
        kept["config"] = config
        return cls(**kept)
