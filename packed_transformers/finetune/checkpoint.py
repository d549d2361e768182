"""Fine-tuning checkpoints: everything needed to continue a run exactly (`--resume`).

    OUTPUT/checkpoint/            the latest only, replaced atomically (common.files.atomic_folder)
        model.safetensors         the weights (safetensors: nothing unpickled on load)
        training_state.pt         AdamW's and the schedule's state, torch's RNG state
                                  (tensors, numbers and dicts: read with weights_only=True)
        progress.json             where the run stands: epoch, batches done in it, the
                                  epoch's running sums, steps, training seconds, the config

A checkpoint is written after every epoch (validated, its metrics line written) and when
SIGINT or SIGTERM stops a run between two steps. The batch order of an epoch is a pure
function of the seed and the epoch (inference.batching), so the position in it is a count
of batches; the dropout stream continues from the saved RNG state: a resumed run's weights
equal those of the run that was never stopped (tests/finetune/test_finetune_resume.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import torch

from packed_transformers.common.files import atomic_folder

CHECKPOINT = "checkpoint"


def checkpoint_path(output: Path) -> Path:
    return Path(output) / CHECKPOINT


def weights_finite(model) -> bool:
    """Whether every parameter is finite (one fused norm per tensor, then one check)."""
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(torch.stack(norms)).all())


def save_checkpoint(output: Path, model, optimizer, scheduler, progress: dict) -> Path:
    """Write the checkpoint (replacing the previous one only once complete). -> its folder."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    with atomic_folder(checkpoint_path(output)) as tmp:
        try:
            save_model(model, str(tmp / "model.safetensors"))
        except SafetensorError as err:  # safetensors' I/O errors: an OSError naming the file
            found = re.search(r"os error (\d+)", str(err))
            code = int(found.group(1)) if found else errno.EIO
            raise OSError(
                code, os.strerror(code), str(checkpoint_path(output) / "model.safetensors")
            ) from None
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": torch.get_rng_state()}  # fmt: skip
        torch.save(state, tmp / "training_state.pt")
        (tmp / "progress.json").write_text(json.dumps(progress, indent=1) + "\n")
    return checkpoint_path(output)


def read_progress(output: Path) -> dict | None:
    """The checkpoint's progress.json, or None if the folder has no checkpoint."""
    path = checkpoint_path(output) / "progress.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not readable ({err})") from None


def load_checkpoint(output: Path, model, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, schedule and RNG from the checkpoint. -> its progress."""
    from safetensors.torch import load_model

    folder = checkpoint_path(output)
    progress = read_progress(output)
    load_model(model, str(folder / "model.safetensors"))
    state = torch.load(folder / "training_state.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return progress
