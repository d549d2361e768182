"""Whole-input packed inference on a Ray cluster, every row written exactly once: what
`python -m packed_transformers.finetune.embed --ray ADDRESS` and `python -m packed_transformers.finetune.predict --ray ADDRESS` run.

    inputs: a file, a glob or a folder of JSON lines (.jsonl, .json) and Parquet (.parquet),
            in sorted file order; row `index` = the 0-based line (row) number across them
      -> plan (driver): chunks of up to --chunk-rows rows; JSON lines are counted (blank
         lines refused) and each chunk's byte offset kept; Parquet chunks are row groups
      -> ray.data.from_items(chunks).map_batches(ShardWriter, batch_size=1, N actors):
         each actor loads the model once (ray_jobs.actors), and for each chunk reads its
         rows (checked as the single-process command checks them), packs and runs them,
         and writes part-NNNNNN.parquet by atomic rename: a chunk's shard has one name, so
         a retried chunk (a killed worker) replaces its shard rather than adding one
      -> verify: the shards' `index` columns are 0..N-1, no gap, no repeat
      -> manifest.json (rows, shards, model, command), then the folder is renamed into
         place: a failure leaves no --output folder and no manifest.

Until then the job writes in `.OUT.partial` beside --output, with plan.json (the job and
each chunk's input: file, rows, a hash of its bytes; Parquet: the file's size and mtime). A chunk with a bad row is refused with the
single-process command's one line (file:line) while the other chunks go on; the job then
exits 2 keeping their shards, and the same command run again (the input fixed) computes
only the chunks whose shard is missing or whose file changed, as after an interrupt.

Shard columns: `index` (int64) and `embedding` (list of float32), or `label` (multi-label:
`labels`) and `scores` (list of float64: predict's rounded scores). Every node must see
the model folder, the inputs and the output's parent folder at the same paths (a shared
filesystem). `python -m packed_transformers.finetune.ray_job gather OUT --output F` reads a finished job back
into one .npy (embeddings) or JSON lines file (predictions) in input order.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.cli import refuse
from packed_transformers.common.files import (
    FolderInUse,
    atomic_path,
    describe_os_error,
    lock_folder,
    model_fingerprint,
    replace_folder,
    write_json_atomic,
)
from packed_transformers.common.install_advice import pip_install
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.ray_jobs.shards import (
    JobIncomplete,
    ShardWriter,
    input_files,
    partial_folder,
    plan_chunks,
    reusable_chunks,
    verify_shards,
)

MANIFEST = "manifest.json"


# ----- the driver ----------------------------------------------------------------------------------
def check_output(output: Path, files: list[Path], overwrite: bool) -> str | None:
    """The one line refusing --output, or None: not over or inside an input, not a file,
    not a finished job unless --overwrite, not another non-empty folder."""
    resolved = output.resolve()
    for path in files:
        source = path.resolve()
        if source == resolved or resolved in source.parents:
            return f"--output {output}: the input {path} is there; an output never replaces an input"
    if output.exists() and not output.is_dir():
        return f"--output {output}: exists and is not a folder; --ray writes a folder of Parquet shards"
    if (output / MANIFEST).exists():
        if not overwrite:
            return f"--output {output}: holds a finished job ({MANIFEST}); give --overwrite to replace it, or a new folder"
    elif output.is_dir() and any(output.iterdir()):
        return f"--output {output}: a folder that is not a job's output (no {MANIFEST}); give a new folder"
    return None


def unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """One line if a cluster address (`HOST:PORT`, or `ray://HOST:PORT` for Ray Client) takes
    no connection within `timeout_s`, else None. Ray itself retries an unreachable address
    for minutes, logging as it goes, and ends in a long traceback."""
    import socket

    if address in ("local", "auto"):
        return None
    client = address.startswith("ray://")
    where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":") if ":" in where else (where, "", "")
    host = host.strip("[]") or where
    if port and not port.isdigit():
        return f"--ray {address}: expected HOST:PORT (a cluster's address), 'auto' or 'local'"
    try:
        socket.create_connection((host, int(port or (10001 if client else 6379))), timeout=timeout_s).close()
    except OSError as err:
        return (
            f"--ray {address}: no Ray cluster answers there ({err.strerror or err}); start one (ray start --head) "
            "and give its address, 'auto' for the one on this machine, or 'local'"
        )
    return None


def start_ray(address: str, workers: int, threads: int, quiet: bool):
    """`local`: a cluster of this machine (workers x threads CPUs); `auto`: the running
    cluster `ray start` made; anything else: that address."""
    import logging

    import ray

    options = {"logging_level": logging.WARNING, "log_to_driver": False, "include_dashboard": False}
    if address == "local":
        # address "local": a new instance of this process's own. Without it Ray joins the
        # newest cluster `ray start` left on this machine (and refuses num_cpus there): found
        # when a test's cluster was up beside a `--ray local` job
        ray.init(address="local", num_cpus=workers * threads, **options)
    else:
        ray.init(address=address, **options)
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-job INFO lines, not the user's news
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = not quiet
    context.print_on_execution_start = False
    return ray


def failure_line(err: BaseException) -> tuple[str, int]:
    """A Ray failure -> (one line, exit code): the user's mistake (a bad row, an unreadable
    file) found in the exception chain is exit 2, anything else exit 1."""
    seen, stack = set(), [err]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ExampleError):
            return str(current).splitlines()[0], 2
        if isinstance(current, OSError):
            return describe_os_error(current), 2
        stack += [getattr(current, "cause", None), current.__cause__, current.__context__]
    return (
        f"the Ray job failed: {str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__}",
        1,
    )


@dataclass
class JobPlan:
    """A job checked and planned, before any cluster starts: its input files, chunks, the
    partial folder its shards go to, the job's identity (what kept shards must match) and
    the chunk numbers kept from an earlier run."""

    files: list
    chunks: list
    partial: Path
    job: dict
    kept: set


def plan_job(args, kind: str, options: dict, text_field: str, pair_field: str | None, check_model) -> JobPlan:
    """The inputs, the output, the model (check_model) and the cluster's address checked, the
    output locked, the kept chunks found. ExampleError / FolderInUse / OSError: the user's."""
    files = input_files(str(args.input))
    wrong = check_output(args.output, files, args.overwrite)
    if wrong:
        raise ExampleError(wrong)
    chunks = plan_chunks(files, args.chunk_rows, text_field)
    partial = partial_folder(args.output)
    # Kept shards are tied to the model's content, not its path: a folder updated in place
    # (a new revision downloaded there, a model re-saved) recomputes every chunk.
    job = {"kind": kind, "model": str(Path(args.model).resolve()), "folder": str(partial),
           "model_fingerprint": model_fingerprint(args.model),
           "text_field": text_field, "pair_field": pair_field,
           "options": {**options, "threads": args.threads_per_worker}}  # fmt: skip
    job_key = {k: v for k, v in job.items() if k != "folder"}
    if check_model is not None:
        check_model()
    wrong = unreachable(args.ray)  # before anything is written beside the output
    if wrong:
        raise ExampleError(wrong)
    lock_folder(args.output, f"{kind} job writing this output")  # one job per output at a time
    return JobPlan(files, chunks, partial, job, reusable_chunks(partial, job_key, chunks))


def run_chunks(ray, todo: list[dict], job: dict, args) -> list[dict]:
    """Each chunk to do through a ShardWriter actor (a packed replica) -> its result rows."""
    if not todo:
        return []
    return (
        ray.data.from_items(todo, override_num_blocks=len(todo))
        .map_batches(
            ShardWriter,
            fn_constructor_kwargs={"job": job},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=min(args.workers, len(todo))),
            num_cpus=args.threads_per_worker,
        )  # fmt: skip
        .take_all()
    )


def run_job(
    args,
    kind: str,
    options: dict,
    text_field: str,
    pair_field: str | None = None,
    described: dict | None = None,
    check_model=None,
) -> int:
    """The whole job (module docstring); prints one JSON summary line. -> exit code: 0;
    2 for the user's mistakes (bad rows, unreadable inputs: named in one line; the chunks
    that ran are kept for the next run); 1 where Ray itself failed. described: what the
    manifest says of the model besides (predict: its label names, in class order).
    check_model: run after the inputs and output are checked and before any cluster starts
    (ExampleError: one line), so that cheap mistakes are answered first."""
    started = time.perf_counter()
    if importlib.util.find_spec("ray") is None:  # before any input is read or model loaded
        return refuse(f"--ray {args.ray}: Ray is not installed in this Python ({pip_install('ray')})")
    try:
        plan = plan_job(args, kind, options, text_field, pair_field, check_model)
    except (ExampleError, FolderInUse) as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    chunks, partial, kept = plan.chunks, plan.partial, plan.kept
    total = sum(c.rows for c in chunks)
    todo = [asdict(c) for c in chunks if c.number not in kept]
    try:
        ray = start_ray(args.ray, args.workers, args.threads_per_worker, args.quiet) if todo else None
    except Exception as err:  # noqa: BLE001 - ray.init raises ConnectionError, RuntimeError, ValueError, ...
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return refuse(f"--ray {args.ray}: the cluster could not be joined ({reason})")
    try:
        done = run_chunks(ray, todo, plan.job, args)
        refused = sorted((r for r in done if r["error"]), key=lambda r: r["number"])
        if refused:
            rows = sum(r["rows"] for r in done if not r["error"]) + sum(
                c.rows for c in chunks if c.number in kept
            )
            return refuse(
                f"{refused[0]['error']} ({len(refused)} of {len(chunks)} chunks refused; the other {rows:,} "
                f"rows are kept in {partial}: fix the input and run the same command again to compute only what is "
                f"missing)"
            )
        shards = verify_shards(partial, chunks)
        seconds = time.perf_counter() - started
        manifest = {
            "kind": kind, "rows": total, "shards": shards, "model": plan.job["model"],
            "inputs": [str(p) for p in plan.files], "text_field": text_field,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "ray": args.ray,
            "workers": args.workers, "threads_per_worker": args.threads_per_worker,
            "chunks_run": len(done), "chunks_kept": len(kept), "seconds": round(seconds, 3),
            **(described or {}),
        }  # fmt: skip
        (partial / "plan.json").unlink(missing_ok=True)
        write_json_atomic(partial / MANIFEST, manifest)
        replace_folder(partial, args.output)  # a finished job there (--overwrite): aside, then removed
    except Exception as err:  # noqa: BLE001 - Ray wraps the workers' errors; one line for all
        line, code = (
            (f"the job is incomplete: {err}", 1) if isinstance(err, JobIncomplete) else failure_line(err)
        )
        print(f"error: {line}; nothing was written at {args.output} (finished chunks are kept in {partial})",
              file=sys.stderr)  # fmt: skip
        return code
    finally:
        if ray is not None:
            ray.shutdown()
    summary = {"rows": total, "shards": len(shards), "chunks_run": len(done), "chunks_kept": len(kept),
               "seconds": round(seconds, 3), "rows_per_second": round(total / seconds, 1),
               "workers": args.workers, "output": str(args.output)}  # fmt: skip
    print(json.dumps(summary))
    return 0


# ----- reading a finished job back ----------------------------------------------------------------
def read_job(folder: Path):
    """A finished job's manifest and its rows in input order: (manifest, pyarrow Table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ExampleError(f"{folder}: no {MANIFEST}; not a finished --ray job (a failed one leaves none)")
    manifest = json.loads(manifest_path.read_text())
    table = pa.concat_tables([pq.read_table(folder / s["file"]) for s in manifest["shards"]])
    table = table.take(np.argsort(table.column("index").to_numpy(), kind="stable"))
    if table.num_rows != manifest["rows"] or not np.array_equal(
        table.column("index").to_numpy(), np.arange(manifest["rows"])
    ):
        raise ExampleError(f"{folder}: the shards do not hold rows 0..{manifest['rows'] - 1} once each")
    return manifest, table


def gather(folder: Path, output: Path) -> int:
    """A finished job -> one file in input order: embeddings as .npy float32 [N, D];
    predictions as commands.predict's JSON lines."""
    manifest, table = read_job(folder)
    output.parent.mkdir(parents=True, exist_ok=True)
    if manifest["kind"] == "embed":
        column = table.column("embedding").combine_chunks()
        width = len(column[0]) if len(column) else 0
        array = column.values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, width)
        with atomic_path(output) as tmp, tmp.open("wb") as f:
            np.save(f, array)
    else:
        names = manifest["labels"]
        with atomic_path(output) as tmp, tmp.open("w") as f:
            for row in table.to_pylist():  # predict's lines: scores by label name
                row["scores"] = dict(zip(names, row["scores"]))
                f.write(json.dumps(row, allow_nan=False) + "\n")
    print(json.dumps({"rows": manifest["rows"], "output": str(output)}))
    return 0


def main(argv=None) -> int:
    from packed_transformers.common.cli import command_parser

    parser = command_parser("python -m packed_transformers.finetune.ray_job", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    reading = commands.add_parser("gather", help="a finished job's shards -> one .npy or JSON lines file")
    reading.add_argument("folder", type=Path, help="the --output folder of a --ray job")
    reading.add_argument(
        "--output", required=True, type=Path, help=".npy (embeddings) or .jsonl (predictions)"
    )
    args = parser.parse_args(argv)
    from packed_transformers.common.files import output_over_inputs

    wrong = output_over_inputs(args.output, [], [args.folder])
    if wrong:
        return refuse(wrong)
    try:
        return gather(args.folder, args.output)
    except ExampleError as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))


if __name__ == "__main__":
    sys.exit(main())
