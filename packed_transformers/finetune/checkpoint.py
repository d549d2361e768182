"""Fine-tuning checkpoints: every run's format and resume policy (components.checkpoint),
the latest only, its model/ in the run's own names (safetensors, loaded strictly) and the
progress (finetune.run_folder.RunState) as JSON in training_state.pt beside AdamW's, the
schedule's and every RNG's state. Written after every epoch's validation and when a signal
stops a run; an epoch's batch order is a pure function of seed and epoch, so the position in
it is a count of batches: a resumed run's weights equal the unstopped run's
(tests/finetune/test_finetune_resume.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from packed_transformers.components import checkpoint as ckpt

KEEP = 1  # a fine-tuning run keeps its latest checkpoint only (as many copies of the model as before)


def checkpoints_folder(output: Path) -> Path:
    return Path(output) / "checkpoints"


def write_weights(model):
    """The checkpoint's model/ writer: config.json and every parameter and buffer under the
    run's own names (safetensors' save_model: tied tensors stored once)."""

    def write(folder: Path) -> None:
        from safetensors.torch import save_model

        folder.mkdir(parents=True, exist_ok=True)
        model.config.to_json_file(folder / "config.json")
        save_model(model, str(folder / "model.safetensors"))

    return write


def save_checkpoint(output: Path, model, optimizer, scheduler, progress: dict) -> Path:
    """Write the checkpoint of `progress` (RunState.progress()) and keep only it. -> its folder.
    OSError (the disk's answer) or ckpt.CheckpointError (a writer's own error, one line)."""
    state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": [ckpt.rng_state()],  # one process: the list every run's checkpoint holds
        "state": json.dumps(progress),
    }
    return ckpt.save_checkpoint(checkpoints_folder(output), progress["steps"], model, state, KEEP,
                                write_weights(model))  # fmt: skip


def has_checkpoint(output: Path) -> bool:
    """Whether OUTPUT holds any checkpoint folder (intact or not)."""
    return bool(ckpt.list_checkpoints(checkpoints_folder(output)))


def read_progress(output: Path) -> dict | None:
    """The newest intact checkpoint's progress; None without one. ckpt.CheckpointError where
    there are checkpoints and none intact, or its state is not plain values."""
    if not has_checkpoint(output):
        return None
    newest = ckpt.latest_valid_checkpoint(checkpoints_folder(output))
    if newest is None:
        raise ckpt.CheckpointError(f"{checkpoints_folder(output)} holds no intact checkpoint")
    return json.loads(ckpt.load_training_state(newest)["state"])


def load_checkpoint(output: Path, model, optimizer, scheduler) -> tuple[Path, dict]:
    """Restore weights, optimizer, schedule and RNG from the checkpoint resume_from picks.
    -> (its folder, its progress). ckpt.CheckpointError when none is left to resume from."""
    from safetensors.torch import load_model

    def load_weights(path: Path, state: dict) -> None:
        load_model(model, str(path / "model" / "model.safetensors"))  # strict: every key, no other
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    path, state = ckpt.resume_from(checkpoints_folder(output), load_weights)
    ckpt.set_rng_state(state["rng"][0])
    return path, json.loads(state["state"])
