"""Embed a file of texts with a sentence-transformers (or BERT) folder, packing them.

    python -m packed_transformers.finetune.embed --model DIR --input texts.jsonl --output embeddings.npy
        [--batching packed | sorted | padded] [--dtype float32 | bfloat16 | int8] [--device cpu | cuda]
        [--runtime torch | openvino]
        [--pooling mean] [--normalize | --no-normalize] [--max-length N] [--text-field text]

--input: JSON lines, one object per line with a string field "text" (--text-field);
row i of the float32 [n, D] array written to --output (.npy) is the embedding of line i
(a blank line is an error: it would shift every row after it). DIR is a
sentence-transformers folder (modules.json: Transformer -> Pooling (-> Normalize); its
pooling mode, Normalize, max_seq_length and do_lower_case are followed), or any BERT
folder with --pooling. Texts longer than max_seq_length tokens are truncated and counted,
as sentence-transformers does.

Streaming: the input is read twice (once to count and check the lines, once to embed
them chunk by chunk), and the array is written as it is computed into `.NAME.partial`
beside --output, renamed to --output at the end, so memory stays bounded by one chunk and
nothing half-written is ever left under the output's name. Ctrl-C, SIGTERM or a kill keep
the rows written (counted in `.NAME.partial.json` after every chunk): the same command run
again continues after them. A one-line JSON summary goes to
stdout (texts/s, real-token fraction, truncated count).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # option and path mistakes answered before torch is imported
    from packed_transformers.commands.parsers import embed_parser
    from packed_transformers.common.preflight import exit_on_path_mistakes, value_of

    early = embed_parser(__doc__).parse_args()  # --help, a mistyped or missing option: exits here

    ray = value_of(sys.argv[1:], "--ray") is not None  # --input may then be a folder or a glob
    exit_on_path_mistakes({"--model": "folder", "--input": "inputs" if ray else "json"})
    from packed_transformers.inference.runtime_choice import exit_on_machine_refusal

    exit_on_machine_refusal(early, ray)  # int8 without VNNI, bf16 without its instructions: no torch yet

import errno
import io
import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from packed_transformers.commands.parsers import embed_parser
from packed_transformers.common.cli import below_one, refuse
from packed_transformers.common.files import (
    FolderInUse,
    describe_os_error,
    lock_folder,
    model_files_identity,
    open_private,
    output_file,
    output_over_inputs,
    regular_file,
    write_json_atomic,
)
from packed_transformers.data.classification_data import ExampleError, example_of_line
from packed_transformers.door.exported_folder import is_exported, settle_exported_arguments
from packed_transformers.door.opener import ForEmbedding, open_folder
from packed_transformers.inference.embedding import iter_encode
from packed_transformers.inference.options import InferenceOptions
from packed_transformers.inference.runner import runner_of, runtime_problem
from packed_transformers.inference.runtime_choice import resolved_runtime


def run_on_ray(args) -> int:
    """--ray: the whole input on a Ray cluster (ray_jobs/job.py), Parquet shards out."""
    from packed_transformers.ray_jobs.job import run_job

    if args.device != "cpu":
        print(
            "error: --ray runs replicas on CPUs; give --device cpu (or run without --ray on the GPU)",
            file=sys.stderr,
        )
        return 2
    options = {"pooling": args.pooling, "normalize": args.normalize, "max_length": args.max_length,
               "prompt_name": args.prompt_name, "batching": args.batching, "batch_size": args.batch_size,
               "max_sequences_per_pack": args.max_sequences_per_pack, "algorithm": args.algorithm,
               "dtype": args.dtype, "text_column": args.text_field, "compile": args.compile}  # fmt: skip

    def check_model():  # the folder and the prompt, in one line, before any cluster starts
        encoder = open_folder(
            args.model, ForEmbedding(args.pooling, normalize=args.normalize, max_length=args.max_length)
        )
        encoder.prompt(args.prompt_name)

    return run_job(args, "embed", options, args.text_field, check_model=check_model)


def count_lines(path: Path, text_field: str) -> int:
    """Lines of the input, each checked to be non-blank (row i must be line i)."""
    n = 0
    with path.open("rb") as f:
        from packed_transformers.data.classification_data import bounded_lines

        for n, raw in bounded_lines(f, str(path)):
            if not raw.strip():
                raise ExampleError(
                    f"{path}:{n}: blank line; every line must be a JSON object with a string "
                    f"'{text_field}' (row i of the output is line i)"
                )
    if n == 0:
        raise ExampleError(f"{path}: no lines (empty file)")
    return n


def read_texts(path: Path, text_field: str) -> Iterator[str]:
    """The text of each line, checked as it is read (one-line errors naming file:line)."""
    with path.open("rb") as f:
        from packed_transformers.data.classification_data import bounded_lines

        for number, raw in bounded_lines(f, str(path)):
            # data.text_rule, as the server applies it; a blank text is refused
            yield example_of_line(raw, f"{path}:{number}", text_field, None, empty_ok=False)[0]


STOPPED_BY = [signal.SIGINT]  # the signal that ended the run (SIGTERM's handler sets it)


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM while embedding: the message says what is kept."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def partial_paths(output: Path) -> tuple[Path, Path]:
    """Where rows go until the array is complete: the .npy being written, and what it was
    computed from with how many rows it holds (rewritten after every chunk)."""
    target = output_file(output)
    return target.with_name(f".{target.name}.partial"), target.with_name(f".{target.name}.partial.json")


def job_of(args, encoder, options: InferenceOptions, n: int) -> dict:
    """What an interrupted run's rows were computed from: resumed only if all of it is equal."""
    stat = args.input.stat()
    return {"input": str(args.input.resolve()), "input_bytes": stat.st_size, "input_mtime_ns": stat.st_mtime_ns,
            "lines": n, "model": str(Path(args.model).resolve()), "model_files": model_files_identity(args.model),
            "dimension": encoder.dimension,
            "text_field": args.text_field, "pooling": args.pooling, "normalize": args.normalize,
            "max_length": args.max_length, "options": asdict(options)}  # fmt: skip


def rows_kept(data_path: Path, state_path: Path, job: dict, header_bytes: int) -> int:
    """Rows an interrupted run of the same job left in data_path (its file cut back to
    them: a kill may have left part of a chunk after the last count), else 0."""
    if not regular_file(state_path) or not regular_file(data_path):  # never read through a link or a FIFO
        return 0
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return 0
    rows = state.pop("rows_written", 0) if isinstance(state, dict) else 0
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        return 0  # a damaged count: start over (the partial file is rewritten from row 0)
    size = header_bytes + rows * job["dimension"] * 4
    if state != job or data_path.stat().st_size < size:
        return 0
    os.truncate(data_path, size)
    return rows


def write_embeddings(args, encoder, options: InferenceOptions, n: int) -> tuple[float, int]:
    """Embed the input into a partial .npy (header first, rows appended chunk by chunk, the
    count kept beside it after every chunk), renamed to --output when complete. A run
    stopped by Ctrl-C, SIGTERM or a kill leaves the partial file: the same command run
    again continues after its rows. -> (seconds spent, rows an earlier run kept)."""
    from tqdm import tqdm

    if is_exported(
        args.model
    ):  # its graph opened and checked (exported_backend) before anything is written or shown
        runner_of(encoder, options.device, options.dtype, options.compile, options.runtime)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False,
              "shape": (n, encoder.dimension)}  # fmt: skip
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    job = job_of(args, encoder, options, n)
    data_path, state_path = partial_paths(args.output)
    # One run per output at a time: a second would truncate the first's partial file.
    lock_folder(output_file(args.output), "finetune.embed writing this output")
    if state_path.is_symlink() or (state_path.exists() and not regular_file(state_path)):
        raise OSError(errno.EEXIST, "is not a regular file (a link, FIFO or device) but this command's own "
                      "record of kept rows; remove it and run the command again", str(state_path))  # fmt: skip
    start = rows_kept(data_path, state_path, job, len(buffer.getvalue()))
    if start:
        print(f"continuing after the {start:,} rows an interrupted run kept ({data_path})", file=sys.stderr)
    started = time.perf_counter()
    written = start
    with open_private(data_path, keep=bool(start)) as f:
        if start:
            f.seek(0, os.SEEK_END)
        else:
            f.write(buffer.getvalue())
            write_json_atomic(state_path, {**job, "rows_written": 0})
        try:
            with tqdm(total=n, initial=start, unit="text", disable=args.quiet, file=sys.stderr,
                      dynamic_ncols=True) as bar:  # fmt: skip
                texts = itertools.islice(read_texts(args.input, args.text_field), start, None)
                where = lambda i: f"{args.input}:{start + i + 1}"  # noqa: E731
                for chunk in iter_encode(texts, encoder, options, where=where):
                    f.write(np.ascontiguousarray(chunk, dtype="<f4").tobytes())
                    f.flush()
                    written += len(chunk)
                    write_json_atomic(state_path, {**job, "rows_written": written})
                    bar.update(len(chunk))
        except (ExampleError, OSError):
            # A bad line or a failed write: the input will change before a rerun, so rows
            # kept for it could never be continued from; nothing is left behind.
            f.close()
            data_path.unlink(missing_ok=True)
            state_path.unlink(missing_ok=True)
            raise
        except KeyboardInterrupt:
            raise Interrupted(
                f"{written:,} of {n:,} rows are kept in {data_path}; run the same command again to continue "
                "from them",
                STOPPED_BY[0],
            ) from None
    if written != n:  # the file changed between the count and the read
        data_path.unlink(missing_ok=True)
        state_path.unlink(missing_ok=True)
        raise ExampleError(f"{args.input}: {written} lines read, {n} counted; the file changed while read")
    os.replace(data_path, output_file(args.output))
    state_path.unlink(missing_ok=True)
    return time.perf_counter() - started, start


def main(argv=None) -> int:
    args = embed_parser(__doc__).parse_args(argv)
    wrong = below_one(args, ("batch_size", "max_sequences_per_pack", "chunk_texts", "max_length", "workers",
                             "threads_per_worker", "chunk_rows"))  # fmt: skip
    if not wrong and not args.chunk_seconds >= 0:  # NaN too
        wrong = f"--chunk-seconds must be 0 (chunks of --chunk-texts) or more, got {args.chunk_seconds}"
    exported = is_exported(args.model)
    if exported:  # its graph decides runtime and dtype: torch is never imported
        wrong = wrong or settle_exported_arguments(args, sys.argv[1:] if argv is None else argv, "embed")
    else:
        wrong = wrong or runtime_problem(args.runtime, args.device, args.dtype, bool(args.ray), args.compile)
    if not wrong and not exported:
        chosen = resolved_runtime(args.runtime, "embedding", args.device, args.dtype, ray=bool(args.ray),
                                  compiled=args.compile)  # fmt: skip
        if chosen.why:
            print(chosen.why, file=sys.stderr)
        args.runtime = chosen.runtime
    if not args.ray:
        wrong = wrong or output_over_inputs(args.output, [args.input], [args.model])
        if not wrong and args.output.exists() and not args.overwrite:  # a corpus's embeddings cost minutes
            wrong = (f"--output {args.output}: holds a finished output; give --overwrite to replace it, "
                     "or another path")  # fmt: skip
    if wrong:
        return refuse(wrong)
    if not exported:
        from packed_transformers.model.hf_checkpoint import quiet_transformers

        quiet_transformers(args.verbose)
    if args.ray:
        return run_on_ray(args)
    try:
        if not args.input.exists():
            raise ExampleError(f"{args.input}: file not found")
        if not args.input.is_file():
            raise ExampleError(
                f"{args.input}: not a regular file (a pipe, device or folder); finetune.embed reads its input "
                "twice (counts the lines, then embeds them): save it to a file first"
            )
        n = count_lines(args.input, args.text_field)
        if not args.quiet and sys.stderr.isatty():  # at a terminal: what the first seconds are spent on
            print(f"{n:,} texts in {args.input}; loading {args.model}", file=sys.stderr, flush=True)
        encoder = open_folder(args.model, ForEmbedding(
            args.pooling, args.normalize, args.max_length, args.device, args.attention_backend
        ))  # fmt: skip
        encoder.prompt(args.prompt_name)  # an unknown prompt name: refused before any compute
        options = InferenceOptions.from_args(args)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        seconds, kept = write_embeddings(args, encoder, options, n)
    except Interrupted as err:
        print(f"interrupted: {err}", file=sys.stderr)
        return 128 + int(err.signum)
    except (ExampleError, FolderInUse) as err:
        return refuse(err)
    except OSError as err:
        return refuse(describe_os_error(err))
    stats = encoder.stats
    summary = {
        "texts": n,
        # a continued run: the rows it embedded, and those the interrupted one kept (not timed here)
        **({"embedded_now": n - kept, "kept_from_earlier_run": kept} if kept else {}),
        "dimension": encoder.dimension,
        "seconds": round(seconds, 3),
        "texts_per_second": round((n - kept) / seconds, 1),
        "real_token_fraction": round(stats["tokens"] / max(stats["slots"], 1), 4),
        "truncated": stats["truncated"],
        "batching": args.batching,
        "dtype": args.dtype,
        "runtime": args.runtime,
        "output": str(args.output),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from packed_transformers.common.cli import own_process_handler, run_main

    def stop(signum, frame):  # SIGTERM ends as Ctrl-C does: the rows written are kept
        STOPPED_BY[0] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, own_process_handler(stop))
    sys.exit(
        run_main(
            main,
            "stopped before any row was embedded; nothing was written (the .npy appears only when complete)",
        )
    )
