"""Fine-tuning checkpoints: pretraining's format and resume policy (components.checkpoint),
with fine-tuning's progress in them.

    OUTPUT/checkpoints/step-00000123/   the latest only (keep 1), renamed into place when whole
        model/config.json, model/model.safetensors   the weights in the run's own names
                                   (safetensors: nothing unpickled on load; loaded strictly)
        training_state.pt         AdamW's and the schedule's state, every RNG's state, and
                                  "state": the progress (finetune.run_folder.RunState) as JSON
                                  (tensors, numbers and strings: read with weights_only=True)
        manifest.json             every file's size and sha256, written last

A checkpoint is written after every epoch (validated, its metrics line written) and when
SIGINT or SIGTERM stops a run between two steps. The batch order of an epoch is a pure
function of the seed and the epoch (inference.batching), so the position in it is a count
of batches; the dropout stream continues from the saved RNG state: a resumed run's weights
equal those of the run that was never stopped (tests/finetune/test_finetune_resume.py).
Resume takes the newest checkpoint whose files match their manifest and whose weights load
(components.checkpoint.resume_from, the policy of every training run); none: refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from packed_transformers.components import checkpoint as ckpt

CHECKPOINTS = "checkpoints"
KEEP = 1  # a fine-tuning run keeps its latest checkpoint only (as many copies of the model as before)


def checkpoints_folder(output: Path) -> Path:
    return Path(output) / CHECKPOINTS


def weights_finite(model) -> bool:
    """Whether every parameter is finite (one fused norm per tensor, then one check)."""
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(torch.stack(norms)).all())


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
    folder = checkpoints_folder(output)
    if not has_checkpoint(output):
        return None
    newest = ckpt.latest_valid_checkpoint(folder)
    if newest is None:
        raise ckpt.CheckpointError(f"{folder} holds no intact checkpoint")
    return progress_of(ckpt.load_training_state(newest))


def progress_of(training_state: dict) -> dict:
    return json.loads(training_state["state"])


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
    return path, progress_of(state)
