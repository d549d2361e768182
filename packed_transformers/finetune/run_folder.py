"""The run's output folder and its checkpoint's claims: what a run may start on, what
--overwrite removes, what --resume may change, and the final save.

    OUTPUT/  model/ checkpoint/ summary.json metrics.jsonl validation_predictions.json[l]
"""

from __future__ import annotations

from pathlib import Path

from packed_transformers.common.cli import first_line
from packed_transformers.common.files import describe_os_error
from packed_transformers.data.assets import resolve_asset
from packed_transformers.finetune.errors import FinetuneError


def input_digest(config: dict) -> dict:
    """sha256 of the training and validation files (each file of a glob) and of the tokenizer's
    files (data.vocab_file, else the init checkpoint's: door.folder.tokenizer_files), so that
    --resume refuses data or a tokenizer changed at the same path (the plan of batches came
    from them). -> {"train_file": hex, "validation_file": hex, "tokenizer": hex}."""
    import glob as globbing

    from packed_transformers.common.files import files_digest
    from packed_transformers.door.folder import tokenizer_files

    digests = {}
    for key in ("train_file", "validation_file"):
        spec = resolve_asset(config["data"].get(key))
        if spec is not None:
            digests[key] = files_digest(
                sorted(globbing.glob(spec)) if globbing.has_magic(spec) else [spec], str
            )
    vocab_file = resolve_asset(config["data"].get("vocab_file"))
    tokenizer = (
        [Path(vocab_file)]
        if vocab_file is not None
        else tokenizer_files(resolve_asset(config["model"]["init_checkpoint"]))
    )
    digests["tokenizer"] = files_digest(tokenizer, lambda path: Path(path).name)
    return digests


# What a run writes in its output folder (removed, and only these, by --overwrite).
RUN_FILES = ("model", "checkpoints", "checkpoint", "summary.json", "metrics.jsonl", "validation_predictions.jsonl",
             "validation_predictions.json")  # fmt: skip


def clear_run(output: Path) -> None:
    """--overwrite: remove a previous run's files from `output` (RUN_FILES only: anything
    else in the folder, such as the data, is left alone)."""
    import shutil

    for name in RUN_FILES:
        path = output / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


# Settings a resumed run may change: how it is carried out, not what it computes (a compiled step
# computes the same step). Everything else must equal the checkpoint's config.
CHANGEABLE_ON_RESUME = {
    ("training", "max_seconds"),
    ("execution", "threads"),
    ("training", "progress"),
    ("training", "compile"),
    ("execution", "sharding"),  # checkpoints hold whole weights: any engine resumes them
}


def check_output(output: Path, resume: bool):
    """The output folder may hold nothing finished; --resume needs its checkpoint. -> the
    checkpoint read once (resume: finetune.checkpoint.Resumable) or None."""
    from packed_transformers.components.checkpoint import CheckpointError
    from packed_transformers.finetune.checkpoint import checkpoints_folder, has_checkpoint, resume_point

    if (output / "summary.json").exists() or (output / "model").exists():
        raise FinetuneError(
            f"--output-dir {output}: holds a finished run; choose another folder, or --overwrite to replace it"
        )
    if not resume:
        if has_checkpoint(output):
            raise FinetuneError(
                f"--output-dir {output}: holds an unfinished run ({checkpoints_folder(output)}); "
                "continue it with --resume, replace it with --overwrite, or choose another folder"
            )
        return None
    if not has_checkpoint(output) and (output / "checkpoint" / "progress.json").is_file():
        raise FinetuneError(f"--resume: {output / 'checkpoint'} is a checkpoint of the layout before the one "
                            "training loop (CHANGELOG) and cannot be resumed: start again with --overwrite")  # fmt: skip
    try:
        found = resume_point(output)
    except CheckpointError as err:
        raise FinetuneError(f"--resume: {first_line(err)[:300]}; start over with --overwrite") from None
    if found is None:
        raise FinetuneError(f"--resume: {checkpoints_folder(output)} holds no checkpoint to resume from")
    return found


def resume_differences(config: dict, progress) -> list[str]:
    """The settings (section.key) where `config` differs from the checkpoint's, apart from
    CHANGEABLE_ON_RESUME, keys it lacks by their defaults (common.config_schema); [] for a new run."""
    from packed_transformers.common.config_schema import differences_from_saved
    from packed_transformers.finetune.config import SCHEMA

    if progress is None:
        return []
    saved = progress.extra.config  # an earlier version's: device, threads, sharding under training
    execution = saved.get("execution") or {k: saved["training"].get(k) for k in config["execution"]}
    return differences_from_saved(config, {**saved, "execution": execution}, SCHEMA, CHANGEABLE_ON_RESUME)


def save_final(job, model, output: Path) -> None:
    """The model folder predict reads; a failed save (no space, a file-size limit) is one
    line naming the folder and the checkpoint that is kept, never a traceback."""
    from safetensors import SafetensorError

    from packed_transformers.finetune.checkpoint import checkpoints_folder, read_progress

    try:
        job.save(model, output / "model")
    except (OSError, SafetensorError, RuntimeError) as err:
        kept = checkpoints_folder(output)
        try:
            progress = read_progress(output)
        except Exception:  # noqa: BLE001 - the save's own error is the one to report
            progress = None
        what = (
            f"the checkpoint of epoch {progress.extra.epoch - 1} is kept in {kept}: free the space and run the "
            "same command with --resume to save it"
            if progress is not None
            else "no checkpoint was written"
        )
        reason = describe_os_error(err) if isinstance(err, OSError) else first_line(err)[:200]
        raise FinetuneError(
            f"{output / 'model'}: the final model could not be saved ({reason}); {what}"
        ) from None
