"""What the packing pipeline's workers do, one task at a time (packing.pipeline runs them):
pass 1 scans a piece of an input (validate rows: lengths, prediction counts), pass 2a
compacts a piece into per-shard sequence stores, pass 2b assembles and writes one shard.
Tasks are small picklable records; each worker opens its inputs once (packs.workers)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.files import atomic_path, write_json_atomic
from packed_transformers.packing.compact import SequenceStore, compact_rows, narrow_rows, select_rows
from packed_transformers.packing.shards import assemble, create_shard_datasets, shard_name
from packed_transformers.packing.sources import (
    Limits,
    file_record,
    validate_rows,
)
from packed_transformers.packs.workers import worker_source

PIECE_ROWS = 1 << 16  # rows of one input file handled by one task
READ_ROWS = 1 << 13  # rows read and validated at once inside a task
BLOCK_PACKS = 1 << 13  # packs assembled at once inside a shard task


# Worker tasks are module level so that they pickle; sources come from packs.workers.


@dataclass(frozen=True)
class ScanTask:
    """Pass 1 over rows [start, stop) of input `file_index`."""

    file_index: int
    start: int
    stop: int
    limits: Limits
    skip_invalid: bool


@dataclass(frozen=True)
class CompactTask:
    """Pass 2a over one piece (rows [start, stop) of input `file_index`)."""

    piece: int
    file_index: int
    start: int
    stop: int
    source_start: int  # global index of the input's first row
    work: str
    shards: int
    token_dtype: np.dtype


@dataclass(frozen=True)
class ShardTask:
    """Pass 2b: write output shard `shard` from the `pieces` compacted pieces."""

    shard: int
    pieces: int
    work: str
    output: str
    shard_size: int
    s: int
    m: int
    vocab_size: int


def _scan_piece(task: ScanTask):
    """Pass 1: validate rows [start, stop) of one input. -> (lengths, predictions, problems)."""
    start, stop, limits, skip_invalid = task.start, task.stop, task.limits, task.skip_invalid
    source = worker_source(task.file_index)
    lengths, predictions, problems = [], [], []
    for a in range(start, stop, READ_ROWS):
        b = min(stop, a + READ_ROWS)
        length, prediction, problem = validate_rows(source.read(a, b), limits, source.path, a)
        lengths.append(length)
        predictions.append(prediction)
        problems.extend(problem)
        if problems and not skip_invalid:
            break  # fail fast: the first bad row stops the job
    return np.concatenate(lengths), np.concatenate(predictions), problems


def _hash_input(file_index):
    return file_record(worker_source(file_index).path)


def _compact_piece(task: CompactTask):
    """Pass 2a: the piece's valid sequences, compacted and grouped by destination shard."""
    start, stop, source_start, work, shards = task.start, task.stop, task.source_start, task.work, task.shards
    piece, token_dtype = task.piece, task.token_dtype
    folder = Path(work) / "pieces" / f"piece-{piece:05d}"
    if folder.is_dir():
        return stop - start  # finished before a crash
    dest = np.load(Path(work) / "dest_shard.npy", mmap_mode="r")
    lengths = np.load(Path(work) / "lengths.npy", mmap_mode="r")
    predictions = np.load(Path(work) / "predictions.npy", mmap_mode="r")
    source = worker_source(task.file_index)
    g = slice(source_start + start, source_start + stop)
    keep = np.flatnonzero(np.asarray(lengths[g]) > 0)
    # Reorder whole padded rows (cheap row copies), then drop the padding: grouping
    # compact tokens instead would need an int64 index per token.
    chunks = [
        narrow_rows(source.read(a, min(stop, a + READ_ROWS)), token_dtype)
        for a in range(start, stop, READ_ROWS)
    ]
    rows = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}
    del chunks
    target = np.asarray(dest[g])[keep]
    order = keep[np.argsort(target, kind="stable")]
    store = compact_rows(
        select_rows(rows, order),
        np.asarray(lengths[g])[order],
        np.asarray(predictions[g])[order],
        source_start + start + order,
        token_dtype,
    )
    del rows
    shard_offsets = np.searchsorted(np.sort(target), np.arange(shards + 1))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    store.save(tmp)
    np.save(tmp / "shard_offsets.npy", shard_offsets)
    tmp.rename(folder)
    return stop - start


def _write_shard(task: ShardTask):
    """Pass 2b: gather the shard's sequences from every piece, assemble, write, hash."""
    shard, pieces, work, output, shard_size = task.shard, task.pieces, task.work, task.output, task.shard_size
    s, m, vocab_size = task.s, task.m, task.vocab_size
    record_path = Path(work) / "shards" / f"{shard:05d}.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    import h5py

    table = np.load(Path(work) / "assignment.npy", mmap_mode="r")
    block_table = np.asarray(table[shard * shard_size : (shard + 1) * shard_size])
    stores = []
    for piece in range(pieces):
        folder = Path(work) / "pieces" / f"piece-{piece:05d}"
        offsets = np.load(folder / "shard_offsets.npy")
        if offsets[shard + 1] > offsets[shard]:
            stores.append(SequenceStore.load_slice(folder, int(offsets[shard]), int(offsets[shard + 1])))
    store = SequenceStore.concat(stores)
    path = Path(output) / shard_name(shard)
    p, k = block_table.shape
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w", libver="latest") as f:
            datasets = create_shard_datasets(f, p, s, k, m, vocab_size)
            for a in range(0, p, BLOCK_PACKS):
                packs = assemble(block_table[a : a + BLOCK_PACKS], store, s, m, vocab_size)
                for name, dataset in datasets.items():
                    dataset[a : a + len(packs[name])] = packs[name]
    record = file_record(path)
    record["name"] = path.name
    record["packs"] = int(p)
    record["sequences"] = int(np.count_nonzero(block_table >= 0))
    record_path.parent.mkdir(exist_ok=True)
    write_json_atomic(record_path, record)
    return record


# --------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------
