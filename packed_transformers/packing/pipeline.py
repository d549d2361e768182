"""`python -m packed_transformers.packing pack`: unpacked shards in, verified packed shards out, streaming.

    pass 1   (workers over pieces)  read + validate every row: lengths, prediction counts
    plan                            histogram -> packing algorithm -> PackingPlan
    assign                          plan + lengths + seed -> table [packs, K] of sequence indices
    pass 2a  (workers over pieces)  re-read rows, keep real tokens, group them by output shard
    pass 2b  (workers over shards)  gather each shard's sequences, assemble packs, write the shard
    finish                          metadata.json (sha256 of every input and shard), drop .work/

A piece is a row range of one input file (at most PIECE_ROWS rows), so memory per worker
is bounded by the piece and shard sizes, never by the dataset; the main process holds
only index arrays (a few int64 per sequence). Every file appears under its final name by
an atomic rename, and `.work/` records finished steps: rerunning the same command after a
crash resumes where it stopped and never writes a pack twice.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from packed_transformers.common.constants import BERT_VOCAB_SIZE
from packed_transformers.common.files import FolderInUse, atomic_path, lock_folder, write_json_atomic
from packed_transformers.packing.format import FORMAT_NAME, FORMAT_VERSION, field_dtypes
from packed_transformers.packing.pipeline_tasks import (
    BLOCK_PACKS,
    PIECE_ROWS,
    READ_ROWS,
    CompactTask,
    ScanTask,
    ShardTask,
    _compact_piece,
    _hash_input,
    _scan_piece,
    _write_shard,
)
from packed_transformers.packing.pipeline_work import WORK, PackJob, job_fingerprint, prepare_output, save_npy
from packed_transformers.packing.shards import METADATA
from packed_transformers.packing.sources import (
    Limits,
    check_source_shape,
    describe_problem,
    open_source,
)
from packed_transformers.packs.algorithms import pack
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import assign_sequences
from packed_transformers.packs.workers import run_tasks

SKIPPED = "skipped_rows.jsonl"
__all__ = ["BLOCK_PACKS", "PIECE_ROWS", "READ_ROWS", "SKIPPED", "WORK", "PackJob", "run_pack"]


@dataclass(frozen=True)
class Inputs:
    """The opened inputs of a job: sources, their global row offsets, and the pieces
    (file index, first row, end row) the workers read."""

    sources: list
    starts: np.ndarray  # [files + 1] global index of each file's first row
    pieces: list[tuple[int, int, int]]

    @property
    def rows(self) -> int:
        return int(self.starts[-1])


@dataclass(frozen=True)
class Layout:
    """What the plan and the assignment decide about the output."""

    plan: object  # PackingPlan
    histogram: Histogram
    k: int  # sequences per pack (the [p, K] fields)
    m: int  # masked-token slots per pack
    packs: int
    shards: int


def run_pack(job: PackJob, workers: int = 1, quiet: bool = False) -> dict:
    """Run (or resume, or confirm) a pack job. Returns the metadata written.

    Phases, each a function: open and check the inputs; lock and prepare the output;
    pass 1 (lengths and validation); plan and assignment; pass 2 (group by shard, write
    shards); metadata.json."""
    started = time.perf_counter()
    output = Path(job.output)
    limits = _limits(job)
    inputs = _open_inputs(job, limits)
    fingerprint = job_fingerprint(job, inputs.sources)
    try:  # one pack per folder at a time; held until this process exits
        lock_folder(output, "pack")
    except FolderInUse as err:
        raise PackingInputError(f"--output: {err}") from None
    work = output / WORK
    if prepare_output(output, work, fingerprint):
        if not quiet:
            print(
                f"{output}: already holds this packed dataset (metadata.json matches); nothing to do",
                file=sys.stderr,
            )
        return json.loads((output / METADATA).read_text())
    bar = dict(disable=quiet, unit="seq", unit_scale=True, file=sys.stderr, dynamic_ncols=True)
    summary1 = _pass1(job, inputs, limits, work, workers, bar)
    lengths = np.load(work / "lengths.npy")
    predictions = np.load(work / "predictions.npy")
    layout = _plan_and_assign(job, lengths, predictions, work, summary1["skipped"])
    shard_records = _pass2(job, inputs, layout, work, workers, bar, int(np.count_nonzero(lengths)))
    seconds = time.perf_counter() - started
    metadata = _metadata(
        job, layout, lengths, predictions, summary1, inputs, shard_records, fingerprint, seconds
    )
    write_json_atomic(output / METADATA, metadata)
    shutil.rmtree(work, ignore_errors=True)
    return metadata


def _limits(job: PackJob) -> Limits:
    """What every input row is checked against. Without --vocab-size tokens are stored as
    uint16: an id past it must be refused, not wrapped (70000 would be stored as 4464)."""
    return Limits(
        job.max_sequence_length,
        job.max_predictions_per_seq,
        job.vocab_size or 1 << 16,
        "" if job.vocab_size else " (ids are stored as uint16 without --vocab-size: pass --vocab-size)",
    )


def _open_inputs(job: PackJob, limits: Limits) -> Inputs:
    """Open every input (shapes checked) and cut it into pieces of at most PIECE_ROWS rows."""
    sources = [open_source(path) for path in job.inputs]
    for source in sources:
        check_source_shape(source, limits)
    starts = np.cumsum([0] + [s.rows for s in sources])
    pieces = [
        (f, a, min(s.rows, a + PIECE_ROWS))
        for f, s in enumerate(sources)
        for a in range(0, s.rows, PIECE_ROWS)
    ]
    return Inputs(sources, starts, pieces)


def _pass1(job: PackJob, inputs: Inputs, limits: Limits, work: Path, workers: int, bar: dict) -> dict:
    """Pass 1: read and validate every row; keep lengths and prediction counts (in
    work/lengths.npy, predictions.npy; length 0 = a skipped row) and each input's record.
    A bad row stops the job (nothing left behind) unless --skip-invalid."""
    output, sources, starts, pieces, n = (
        Path(job.output),
        inputs.sources,
        inputs.starts,
        inputs.pieces,
        inputs.rows,
    )
    pass1 = work / "pass1.json"
    if pass1.is_file():
        summary1 = json.loads(pass1.read_text())
    else:
        tasks = [ScanTask(f, a, b, limits, job.skip_invalid) for f, a, b in pieces]
        with tqdm(total=n, desc="pass 1: read + validate", **bar) as progress:
            results = run_tasks(_scan_piece, tasks, workers, sources, progress, lambda t, r: t.stop - t.start)
            records = run_tasks(_hash_input, list(range(len(sources))), workers, sources)
        lengths = np.zeros(n, dtype=np.int16)
        predictions = np.zeros(n, dtype=np.int16)
        problems = []
        for (f, a, _), (length, prediction, problem) in zip(pieces, results):
            g0 = int(starts[f]) + a
            lengths[g0 : g0 + length.size] = length
            predictions[g0 : g0 + prediction.size] = prediction
            problems.extend((f, row, field, message) for row, field, message in problem)
        if problems and not job.skip_invalid:
            f, row, field, message = problems[0]
            # Nothing was written but the job record: remove it, so that the same command
            # runs again once the input is fixed (its fingerprint changes with the file).
            shutil.rmtree(work, ignore_errors=True)
            if output.is_dir() and not any(output.iterdir()):
                output.rmdir()
            raise PackingInputError(
                describe_problem(sources[f].path, row, field, message)
                + " (use --skip-invalid to skip bad rows with a report)"
            )
        skipped = []
        for f, row, field, message in problems:
            lengths[int(starts[f]) + row] = 0
            skipped.append(
                {
                    "file": str(sources[f].path),
                    "row": int(row),
                    "source_index": int(starts[f]) + int(row),
                    "field": field,
                    "problem": message,
                }
            )
        for name, array in (("lengths", lengths), ("predictions", predictions)):
            save_npy(work / f"{name}.npy", array)
        if skipped:
            with atomic_path(output / SKIPPED) as tmp:
                tmp.write_text("".join(json.dumps(r) + "\n" for r in skipped))
        summary1 = {"inputs": records, "skipped": len(skipped)}
        write_json_atomic(pass1, summary1)
    for record, source in zip(summary1["inputs"], sources):
        record["rows"] = int(source.rows)
        record["format"] = source.kind
        record["dtypes"] = source.dtypes
        record["widths"] = {
            "S": int(source.width),
            "P": int(source.predictions_width),
            "NSP_ndim": len(source.shapes["next_sentence_labels"]),
        }
    return summary1


def _plan_and_assign(
    job: PackJob, lengths: np.ndarray, predictions: np.ndarray, work: Path, skipped: int
) -> Layout:
    """The plan from the length histogram, and the assignment of every valid sequence to
    one slot (work/assignment.npy, and each sequence's output shard in dest_shard.npy)."""
    n = lengths.size
    valid = lengths[lengths > 0]
    if valid.size == 0:
        raise PackingInputError(f"the inputs hold no valid sequence ({n} rows, {skipped} skipped)")
    histogram = Histogram.from_lengths(valid, job.max_sequence_length)
    plan = pack(histogram, job.algorithm, job.max_sequences_per_pack)
    # K of the data: as asked (static shapes shared by datasets of one config), the plan's
    # depth for "max", and 1 for the unpacked baseline.
    k = plan.max_depth if job.max_sequences_per_pack is None else job.max_sequences_per_pack
    if job.algorithm == "none":
        k = 1
    if k > 255:
        raise PackingInputError(f"packs of up to {k} sequences do not fit sequence_ids (uint8); use K <= 255")
    table_path = work / "assignment.npy"
    if not table_path.is_file():
        table = assign_sequences(plan, lengths, job.seed, k)
        save_npy(table_path, table)
        dest = np.full(n, -1, dtype=np.int32)
        present = table >= 0
        dest[table[present]] = (np.nonzero(present)[0] // job.shard_size).astype(np.int32)
        save_npy(work / "dest_shard.npy", dest)
        del dest, present
    table = np.load(table_path, mmap_mode="r")
    packs = table.shape[0]
    per_pack = np.where(table >= 0, predictions[np.maximum(table, 0)], 0).sum(axis=1)
    needed = int(per_pack.max())
    m = job.max_predictions_per_pack or max(needed, 1)
    if needed > m:
        raise PackingInputError(
            f"--max-predictions-per-pack {m} is too small: a pack of this plan holds {needed} masked tokens"
        )
    return Layout(plan, histogram, int(k), int(m), int(packs), -(-packs // job.shard_size))


def _pass2(job: PackJob, inputs: Inputs, layout: Layout, work: Path, workers: int, bar: dict, sequences: int):
    """Pass 2: re-read each piece, keep real tokens grouped by output shard (2a), then
    assemble and write every shard (2b). Returns the shards' records."""
    (work / "pieces").mkdir(exist_ok=True)
    token_dtype = field_dtypes(job.vocab_size or BERT_VOCAB_SIZE)["input_ids"]
    tasks = [
        CompactTask(i, f, a, b, int(inputs.starts[f]), str(work), layout.shards, token_dtype)
        for i, (f, a, b) in enumerate(inputs.pieces)
    ]
    with tqdm(total=inputs.rows, desc="pass 2: group by shard", **bar) as progress:
        run_tasks(_compact_piece, tasks, workers, inputs.sources, progress, lambda t, r: r)
    tasks = [
        ShardTask(
            shard=d,
            pieces=len(inputs.pieces),
            work=str(work),
            output=job.output,
            shard_size=job.shard_size,
            s=job.max_sequence_length,
            m=layout.m,
            vocab_size=job.vocab_size or BERT_VOCAB_SIZE,
        )
        for d in range(layout.shards)
    ]
    with tqdm(total=sequences, desc="pass 2: write shards", **bar) as progress:
        return run_tasks(_write_shard, tasks, workers, inputs.sources, progress, lambda t, r: r["sequences"])


def _metadata(
    job,
    layout: Layout,
    lengths,
    predictions,
    summary1,
    inputs: Inputs,
    shard_records,
    fingerprint,
    seconds: float,
) -> dict:
    """metadata.json: format, shapes, counts derived from the data, every input and shard."""
    valid = lengths[lengths > 0]
    plan, histogram = layout.plan, layout.histogram
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "S": job.max_sequence_length,
        "K": layout.k,
        "M": layout.m,
        "P": job.max_predictions_per_seq,
        "algorithm": job.algorithm,
        "max_sequences_per_pack": "max" if job.max_sequences_per_pack is None else job.max_sequences_per_pack,
        "seed": job.seed,
        "shard_size": job.shard_size,
        "vocab_size": job.vocab_size,
        "sequences": int(valid.size),
        "packs": layout.packs,
        "real_tokens": int(valid.sum(dtype=np.int64)),
        "efficiency": plan.efficiency,
        "packing_factor": plan.packing_factor,
        "padding_fraction_unpacked": histogram.padding_fraction_unpacked,
        "theoretical_speedup": plan.theoretical_speedup,
        "masked_tokens": int(predictions[lengths > 0].sum(dtype=np.int64)),
        "input_rows": inputs.rows,
        "skipped_rows": int(summary1["skipped"]),
        "skipped_rows_report": SKIPPED if summary1["skipped"] else None,
        "plan_seconds": plan.seconds,
        "seconds": seconds,
        "length_histogram": histogram.counts.tolist(),
        "inputs": summary1["inputs"],
        "shards": shard_records,
        "job": fingerprint,
    }
