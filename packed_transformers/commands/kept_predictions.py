"""`packed predict`'s classification predictions kept chunk by chunk, as embed keeps its rows
(issue 110 item 3: a predict stopped by Ctrl-C kept nothing, and its bar stood still).

Beside --output (NAME its file name), until the last chunk is written:
    .NAME.partial         the prediction lines so far (JSON lines, input order)
    .NAME.partial.logits  their logits, float32 [rows, C] row after row: the scores at the end
                          (loss, accuracy, ROC-AUC) are computed over every row, kept ones included
    .NAME.partial.json    what they were computed from (input, model files, options, labels) with
                          rows_written and lines_bytes; rewritten by atomic rename after each chunk,
                          the point at which a chunk counts as kept
Chunks are about --chunk-seconds of work (inference.classify.iter_classify). The same command run
again continues after the kept rows (both files cut back to the count: a kill may have left part
of a chunk after it); a record of another job, or a damaged one, starts over. The finished lines
are renamed to --output, and the two other files removed. Never imports torch (an exported
folder's predict runs without it).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.files import (
    lock_folder,
    model_files_identity,
    open_private,
    regular_file,
    write_json_atomic,
)
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.inference.classify import ClassifyPlan, iter_classify
from packed_transformers.inference.options import InferenceOptions
from packed_transformers.inference.predictions import prediction_records

# options that decide only how the work is cut into chunks, not a prediction: a rerun with
# other values continues from the kept rows
CHUNKING_OPTIONS = ("chunk_texts", "chunk_seconds")


@dataclass(frozen=True)
class KeptFiles:
    """The three files an unfinished predict keeps beside its --output."""

    lines: Path
    logits: Path
    record: Path

    @classmethod
    def beside(cls, output: Path) -> KeptFiles:
        name = f".{output.name}.partial"
        return cls(
            output.with_name(name), output.with_name(name + ".logits"), output.with_name(name + ".json")
        )

    def remove(self) -> None:
        for path in (self.lines, self.logits, self.record):
            path.unlink(missing_ok=True)


def job_of(args, options: InferenceOptions, n: int, label_names: list[str], multi_label: bool) -> dict:
    """What kept predictions were computed from: continued only if all of it is equal."""
    stat = args.input.stat()
    settings = {key: value for key, value in asdict(options).items() if key not in CHUNKING_OPTIONS}
    return {"input": str(args.input.resolve()), "input_bytes": stat.st_size, "input_mtime_ns": stat.st_mtime_ns,
            "examples": n, "model": str(Path(args.model).resolve()), "model_files": model_files_identity(args.model),
            "labels": label_names, "multi_label": multi_label, "options": settings}  # fmt: skip


def rows_kept(files: KeptFiles, job: dict, classes: int) -> tuple[int, int]:
    """(rows, bytes of their lines) an interrupted run of the same job kept, both files cut back
    to them; (0, 0) where there is none, it was another job's, or its record is damaged."""
    if not all(regular_file(p) for p in (files.record, files.lines, files.logits)):  # never through a link
        return 0, 0
    try:
        record = json.loads(files.record.read_text())
    except (OSError, ValueError):
        return 0, 0
    if not isinstance(record, dict):
        return 0, 0
    rows, lines_bytes = record.pop("rows_written", None), record.pop("lines_bytes", None)
    counts_valid = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (rows, lines_bytes))
    logits_bytes = rows * classes * 4 if counts_valid else 0
    if (not counts_valid or record != job or files.lines.stat().st_size < lines_bytes
            or files.logits.stat().st_size < logits_bytes):  # fmt: skip
        return 0, 0
    os.truncate(files.lines, lines_bytes)
    os.truncate(files.logits, logits_bytes)
    return rows, lines_bytes


def write_kept_predictions(args, runner, plan: ClassifyPlan, options: InferenceOptions, label_names: list[str],
                           multi_label: bool) -> tuple[np.ndarray, dict, int]:  # fmt: skip
    """Predict the plan's examples chunk by chunk into the kept files, then rename the lines to
    args.output. -> (logits float32 [n, C] of every example, timing of this run's chunks, rows
    an earlier run kept). Ctrl-C or SIGTERM: KeyboardInterrupt whose message says what is kept."""
    from tqdm import tqdm

    n, classes = len(plan.data), len(label_names)
    files = KeptFiles.beside(args.output)
    # One run per output at a time: a second would cut the first's kept files.
    lock_folder(args.output, "packed predict writing this output")
    job = job_of(args, options, n, label_names, multi_label)
    start, lines_bytes = rows_kept(files, job, classes)
    if start:
        print(
            f"continuing after the {start:,} predictions an interrupted run kept ({files.lines})",
            file=sys.stderr,
        )
    written, timing = start, {"seconds": 0.0, "batches": 0}
    with (
        open_private(files.lines, keep=bool(start)) as lines,
        open_private(files.logits, keep=bool(start)) as raw,
    ):
        lines.seek(0, os.SEEK_END)
        raw.seek(0, os.SEEK_END)
        if not start:
            write_json_atomic(files.record, {**job, "rows_written": 0, "lines_bytes": 0})
        try:
            with tqdm(total=n, initial=start, unit="text", disable=args.quiet, file=sys.stderr,
                      dynamic_ncols=True) as bar:  # fmt: skip
                for logits, part in iter_classify(runner, plan, options, start):
                    text = "".join(json.dumps(r, allow_nan=False) + "\n"
                                   for r in prediction_records(logits, label_names, multi_label, written))  # fmt: skip
                    encoded = text.encode()
                    lines.write(encoded)
                    raw.write(np.ascontiguousarray(logits, dtype="<f4").tobytes())
                    lines.flush()
                    raw.flush()
                    written, lines_bytes = written + len(logits), lines_bytes + len(encoded)
                    write_json_atomic(
                        files.record, {**job, "rows_written": written, "lines_bytes": lines_bytes}
                    )
                    timing["seconds"] += part["seconds"]
                    timing["batches"] += part["batches"]
                    bar.update(len(logits))
        except (ExampleError, OSError):
            # non-finite scores or a failed write: nothing a rerun of this job could continue from
            lines.close()
            raw.close()
            files.remove()
            raise
        except KeyboardInterrupt:
            raise KeyboardInterrupt(
                f"{written:,} of {n:,} predictions are kept in {files.lines}; run the same command again to "
                "continue from them"
            ) from None
    logits = np.fromfile(files.logits, dtype="<f4").reshape(n, classes)
    os.replace(files.lines, args.output)
    files.remove()
    done = n - start
    timing["examples"] = done
    timing["examples_per_second"] = done / timing["seconds"] if timing["seconds"] else None
    return logits, timing, start
