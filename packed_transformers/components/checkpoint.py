"""Checkpoints: atomic folders that resume a run exactly.

OUTPUT/checkpoints/step-00000123/
    model/               Hugging Face BertForPreTraining folder (config.json, model.safetensors)
    training_state.pt    each Stateful part's entries (components.run_checkpoint): "state", the
                         run state as JSON (components.run_state.RunState: step, samples, next
                         evaluation point, the job's own progress and data position); "rng",
                         every rank's RNG state; the engine's: the optimizer (+ loss scaler)
    dcp/                 a sharded run's shards of model and optimizer (components.sharding)
    manifest.json        sha256 and size of every file above; written last

A checkpoint is written into a temporary folder and renamed into place, so a crash leaves
either the previous checkpoints or a complete new one. On resume, the newest checkpoint
whose manifest matches its files is used; a corrupt or partial one is reported and skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from packed_transformers.common.cli import first_line
from packed_transformers.common.files import apply_umask, atomic_folder, replace_folder, sha256_file

log = logging.getLogger(__name__)
PREFIX = "step-"


# What a checkpoint must hold to resume: a manifest that lists less proves nothing.
REQUIRED_FILES = {"model/model.safetensors", "model/config.json", "training_state.pt"}


class CheckpointError(RuntimeError):
    pass


def rng_state() -> dict:
    """Every RNG's state, in types `torch.load(weights_only=True)` accepts (numpy's key
    array travels as a tensor)."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (
            name,
            torch.from_numpy(keys.astype(np.int64)),
            int(position),
            int(has_gauss),
            float(cached),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(states: list[dict], rank: int) -> None:
    """This rank's RNG states from a checkpoint's every-rank list (gather_rng_states'); a rank
    the writer did not have (a run resumed on more processes) takes rank 0's."""
    state = states[rank] if rank < len(states) else states[0]
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (name, np.asarray(keys, dtype=np.int64).astype(np.uint32), position, has_gauss, cached)
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_folder(folder: Path, step: int) -> Path:
    """OUTPUT/checkpoints/step-N: the folder of step `step`'s checkpoint."""
    return folder / f"{PREFIX}{step:08d}"


def weights_writer(model, weights: dict | None):
    """The checkpoint's model/ writer: config.json and every parameter and buffer under the
    run's own names (a tied tensor once), from the model itself (safetensors' save_model) or
    from `weights` gathered whole from a sharded run's ranks: no second model is built."""

    def write(folder: Path) -> None:
        from safetensors.torch import save_file, save_model

        folder.mkdir(parents=True, exist_ok=True)
        model.config.to_json_file(folder / "config.json")
        if weights is None:
            save_model(model, str(folder / "model.safetensors"))
        else:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
                      metadata={"format": "pt"})  # fmt: skip

    return write


def save_checkpoint(folder: Path, step: int, state: dict, keep: int, write_model, write_shards=None,
                    rank: int = 0) -> Path:  # fmt: skip
    """The one atomic writer of every run's checkpoint: OUTPUT/checkpoints/step-N written into a
    temporary folder, its manifest last, renamed into place; all but the newest `keep` dropped.
    write_model(model_folder) writes model/ (config.json, model.safetensors); `state` is
    training_state.pt's dict (components.run_checkpoint: its parts' entries). Unsharded, rank 0
    alone calls it. Sharded (write_shards given), every rank does: write_shards(folder) writes
    this rank's part (DCP's dcp/, a collective) into one temporary folder rank 0 made, and rank
    0 writes the rest. -> the checkpoint's folder.
    OSError (the disk's answer) or CheckpointError (a writer's own error, one line)."""
    final = step_folder(folder, step)
    with _temporary(final, rank) if write_shards is not None else atomic_folder(final) as tmp:
        if write_shards is not None:
            write_shards(tmp)
        if rank == 0:
            try:
                write_model(tmp / "model")
                torch.save(state, tmp / "training_state.pt")
            except OSError:
                raise
            except Exception as err:
                # safetensors (SafetensorError) and torch.save's zip writer (RuntimeError
                # "unexpected pos") wrap a failed write in their own types: one line, the
                # path and their reason. The half-written folder is removed.
                raise CheckpointError(
                    f"{final}: writing the checkpoint failed ({first_line(err)}; no space left on the device or a "
                    "file-size limit?); the older checkpoints are intact"
                ) from None
            write_manifest(tmp, step)
    if rank == 0:
        prune(folder, keep)
    return final


@contextlib.contextmanager
def _temporary(final: Path, rank: int):
    """atomic_folder for every rank of a sharded run: rank 0 makes the temporary folder and
    sends its path to every rank; once every rank has written, rank 0 renames it into place
    (the user's umask, an older one of that name renamed aside first) or removes it."""
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent)
    dist.broadcast_object_list(box, src=0)
    tmp, written = Path(box[0]), False
    try:
        yield tmp
        written = True
    finally:
        dist.barrier()
        if rank == 0 and written:
            apply_umask(tmp)
            replace_folder(tmp, final)
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(folder: Path, step: int) -> None:
    """manifest.json (the checkpoint's step, every file's size and sha256): written last."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {
        "step": step,
        "files": {
            str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files
        },
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def prune(folder: Path, keep: int) -> None:
    """Drop all but the newest `keep` checkpoints."""
    for old in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(folder: Path) -> list[Path]:
    """Clean up after a crash mid-save: a checkpoint renamed aside (`.step-N.old-*`, see
    common.files.atomic_folder) whose replacement never arrived is renamed back; every
    other `.step-*` folder is a half-written temporary and is removed, with a warning line
    (every run's: BERT's, the decoder's, fine-tuning's). Returns those."""
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("." + PREFIX)):
        name = path.name[1:].split(".")[0]
        if ".old-" in path.name and not (folder / name).exists():
            path.rename(folder / name)
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, a checkpoint a crash left half-written", path)
        removed.append(path)
    return removed


def list_checkpoints(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def check_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file listed in the manifest is present and intact."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no manifest.json (partial checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_path}: unreadable ({err})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not REQUIRED_FILES <= set(files):
        raise CheckpointError(
            f"{manifest_path}: 'files' must list at least {sorted(REQUIRED_FILES)} (a foreign or edited manifest)"
        )
    for name, record in files.items():
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("bytes"), int)
            or not isinstance(record.get("sha256"), str)
        ):
            raise CheckpointError(f"{manifest_path}: files[{name!r}] must hold 'bytes' and 'sha256'")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if file.stat().st_size != record["bytes"] or sha256_file(file) != record["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in manifest.json (corrupt)")


def intact_checkpoints(folder: Path):
    """The intact checkpoints, newest first; corrupt ones are reported and skipped."""
    for path in reversed(list_checkpoints(folder)):
        try:
            check_checkpoint(path)
        except CheckpointError as err:
            log.error("refusing checkpoint: %s; trying the previous one", err)
            continue
        yield path


def resume_points(folder: Path) -> Iterator[tuple[Path, dict]]:
    """(checkpoint, its training state) of each intact checkpoint, newest first, as the caller
    asks: each one's files hashed and its state loaded once (a run that reads the newest's
    state to check its config, then resumes, hands this same iterator to resume_from)."""
    for path in intact_checkpoints(folder):
        yield path, load_training_state(path)


def resume_from(
    folder: Path, load_weights, points: Iterator[tuple[Path, dict]] | None = None
) -> tuple[Path, dict]:
    """The one resume policy of every training run (BERT's, the decoder's, fine-tuning's), as
    (checkpoint, its training state):

    - the newest checkpoint whose files match its manifest (a corrupt or half-written one is
      reported and the previous one tried);
    - its training state must load: one that holds anything but tensors and plain values is
      never skipped past (CheckpointError names it: someone put it there);
    - `load_weights(path, state)` puts its weights (and, sharded, the optimizer's shards) into
      the run; weights that match the manifest but do not load (damaged before the manifest
      was written, or replaced with it, or of another model) make it a damaged checkpoint, as
      a sha256 mismatch does: reported, the previous one tried;
    - none left: CheckpointError. A --resume with nothing to resume from is refused, never a
      silent start from step 0 (the user asked to continue a run).
    `points`: resume_points(folder) already begun (its newest read once, by the caller)."""
    from safetensors import SafetensorError

    for path, state in resume_points(folder) if points is None else points:
        try:
            load_weights(path, state)
        except CheckpointError:
            raise
        except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as err:
            log.error("refusing checkpoint: %s: its weights cannot be loaded (%s); trying the previous one",
                      path, first_line(err)[:300])  # fmt: skip
            continue
        return path, state
    raise CheckpointError(
        f"{folder} holds no intact checkpoint to resume from; to start over, run without --resume in a "
        f"new --output-dir (or delete {folder.parent})"
    )


def load_training_state(path: Path) -> dict:
    """The optimizer, run and RNG state of a checkpoint. Loaded with weights_only=True:
    a checkpoint may come from anyone, and unpickling arbitrary objects runs their code
    (the sha256 manifest beside the file proves integrity, not origin)."""
    file = path / "training_state.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle.UnpicklingError for forbidden objects, and corrupt files
        raise CheckpointError(
            f"{file}: refused: it holds something other than tensors and plain values ({first_line(err)[:200]})"
        ) from None
