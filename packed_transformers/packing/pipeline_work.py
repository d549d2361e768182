"""The packing job's work folder (OUTPUT/.work): what makes rerunning the same command
after a crash resume where it stopped. A fingerprint of the job (its options and every
input's identity) decides whether the work found there is this job's; finished steps are
files that appear by atomic rename."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.files import atomic_path, write_json_atomic
from packed_transformers.packing.shards import METADATA
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.plan import MaxPerPack

WORK = ".work"


@dataclass(frozen=True)
class PackJob:
    """Everything that defines the packed output (workers do not: they change no byte)."""

    inputs: tuple[str, ...]
    output: str
    algorithm: str
    max_sequences_per_pack: MaxPerPack
    max_sequence_length: int
    max_predictions_per_seq: int
    seed: int
    shard_size: int
    vocab_size: int | None = None
    max_predictions_per_pack: int | None = None
    skip_invalid: bool = False


def save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, array)


def job_fingerprint(job: PackJob, sources) -> dict:
    """What makes two runs produce the same bytes: the options and the inputs' identity."""
    options = asdict(job)
    options.pop("output")
    options["inputs"] = [
        {"name": str(s.path), "bytes": s.path.stat().st_size, "mtime_ns": s.path.stat().st_mtime_ns}
        for s in sources
    ]
    return options


def prepare_output(output: Path, work: Path, fingerprint: dict) -> bool:
    """Create, resume or refuse the output folder. True if it already holds this dataset."""
    if output.exists() and not output.is_dir():
        raise PackingInputError(f"--output {output} exists and is not a directory")
    meta = output / METADATA
    if meta.is_file():
        done = json.loads(meta.read_text()).get("job")
        if _same_job(done, fingerprint):
            return True
        raise PackingInputError(
            f"--output {output} already holds a different packed dataset ({METADATA} was made by other "
            "inputs or options); choose another directory or remove it"
        )
    job_file = work / "job.json"
    if job_file.is_file():
        if not _same_job(json.loads(job_file.read_text()), fingerprint):
            raise PackingInputError(
                f"--output {output} holds an unfinished pack job with other inputs or options "
                f"({job_file}); remove the directory or rerun that job"
            )
    elif output.is_dir() and any(output.iterdir()):
        raise PackingInputError(
            f"--output {output} is not empty and holds no pack job; choose an empty directory"
        )
    work.mkdir(parents=True, exist_ok=True)
    write_json_atomic(job_file, fingerprint)
    for stale in list(output.glob(".*.tmp-*")) + list(work.rglob(".*.tmp-*")):
        stale.unlink()  # half-written files of a crashed run
    return False


def _same_job(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
