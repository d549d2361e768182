"""The run's output folder: one run per folder (locked), a resumed run must be the same run
(model, data and optim settings), config.yaml written last, metrics of steps after a
restored checkpoint forgotten."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from packed_transformers.common.files import FolderInUse, atomic_path, lock_folder, sha256_file
from packed_transformers.components.curves import read_metric_lines
from packed_transformers.components.distributed import barrier
from packed_transformers.components.errors import RunError

# Keys of the fixed sections that change how the run is done, not what it computes.
CHANGEABLE_ON_RESUME = {("data", "loader_workers"), ("data", "validate_batches"), ("data", "check_sha256")}


def check_same_run(previous: dict, config: dict, what: str, changeable=CHANGEABLE_ON_RESUME) -> None:
    """RunError unless `config` keeps the model, data and optim settings of `previous`
    (config.yaml, or the config a checkpoint holds)."""
    for section in ("model", "data", "optim"):
        before, now = (previous or {}).get(section) or {}, config[section]
        changed = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
        changed = [k for k in changed if (section, k) not in changeable]
        if changed:
            key = changed[0]
            raise RunError(
                f"--resume: {section}.{key} is {now.get(key)!r}, {what} has "
                f"{before.get(key)!r}; model, data and optim settings cannot change on resume "
                "(training/eval/logging/execution settings and data.loader_workers, "
                "data.validate_batches, data.check_sha256 can)"
            )


def data_identity(config: dict) -> str | None:
    """sha256 of the training data's metadata.json (its plan, packing factor, K, counts and
    every shard's sha256): the same path holding re-packed data is other data. None for
    synthetic data."""
    if config["data"]["synthetic"]:
        return None
    return sha256_file(Path(config["data"]["train_dir"]) / "metadata.json")


def lock_run_folder(output: Path, rank: int) -> None:
    """One run per folder, every job's: rank 0 holds OUTPUT's lock for the process's lifetime
    (common.files.release_folder gives it back sooner), so that a second run, --resume or
    --overwrite does not write beside this one. RunError, one line, where another holds it."""
    if rank == 0:
        try:
            lock_folder(output, "run")
        except FolderInUse as err:
            raise RunError(f"--output-dir: {err}") from None


def prepare_output(
    output: Path, config: dict, resume: bool, rank: int, changeable=CHANGEABLE_ON_RESUME
) -> None:
    """Lock the folder and refuse one that holds another run (or, on resume, a run of other
    model / data / optim settings). config.yaml is written later (write_run_config)."""
    saved = output / "config.yaml"
    lock_run_folder(output, rank)
    if saved.is_file():
        if not resume:
            raise RunError(
                f"--output-dir {output} holds another run (config.yaml); pass --resume to continue it "
                "or choose another directory"
            )
        check_same_run(yaml.safe_load(saved.read_text()), config, f"the run in {output}", changeable)
    elif output.is_dir() and any(output.iterdir()) and not resume:
        raise RunError(f"--output-dir {output} is not empty and holds no run")
    # Every rank checks before rank 0 writes: otherwise a slower rank finds the config.yaml
    # rank 0 just wrote and refuses the folder as "another run".
    barrier()


def write_run_config(output: Path, config: dict, rank: int) -> None:
    """OUTPUT/config.yaml, written once every check of the run has passed: a refused
    command leaves nothing that would refuse its corrected rerun."""
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        with atomic_path(output / "config.yaml") as tmp:
            tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    barrier()


def forget_metrics_after(path: Path, step: int) -> None:
    """Drop metrics.jsonl lines of steps after `step` (a resumed run logs them again)."""
    if not path.is_file():
        return
    # Complete lines only: a last line cut off by a kill or a full disk is no record.
    kept = [line for line in read_metric_lines(path) if json.loads(line).get("step", 0) <= step]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))
