"""`python -m packed_transformers.packing verify`: every input sequence is in the packs exactly once, unchanged.

Both sides are reduced to one fingerprint per sequence: length, prediction count and
NSP label compared exactly, plus two independent 64-bit position-weighted sums over the
tokens and segments, and over the masked-LM (position, label) slots. Each side is
fingerprinted in its own padded layout, without copying sequences out: the inputs as
[n, S] rows, the packs as [p, S] rows after their structure is checked
(packs.structure: contiguous runs 1..k, positions 0.. within each), so a sequence's
sums are differences of a running sum along its pack. The weights are odd,
so any single changed token, segment, masked position or label always changes both sums;
several changes cancel in both with probability about 2^-128. Presence is exact:
source_index is counted, so a duplicate, a missing or an unknown sequence is always found.
Shard files are checked against the sha256 in metadata.json as well.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from packed_transformers.common.files import sha256_file
from packed_transformers.packing.pipeline import PIECE_ROWS, READ_ROWS, SKIPPED
from packed_transformers.packing.shards import PackedDataset
from packed_transformers.packing.sources import Limits, check_source_shape, open_source, validate_rows
from packed_transformers.packs.structure import first_malformed
from packed_transformers.packs.workers import run_tasks, worker_source

# Rows fingerprinted at a time (packs: half as many, each holding ~2 sequences): the
# temporaries of [rows, S] uint64 then stay in the cache; whole read blocks of 65,536 rows
# ran 4-7x slower.
CHUNK_ROWS = 1024

_WEIGHTS = np.random.default_rng(0x9ACCED).integers(
    0, 2**63, size=(2, 2, 1 << 16), dtype=np.uint64
) * np.uint64(2) + np.uint64(1)  # [hash, tokens/slots, position] odd uint64 weights
_INPUT_WEIGHTS = np.ascontiguousarray(_WEIGHTS.transpose(1, 2, 0))  # [tokens/slots, position, hash]


@dataclass
class Fingerprints:
    """Per-sequence facts that verify compares."""

    source: np.ndarray  # int64 [n]
    lengths: np.ndarray
    predictions: np.ndarray
    nsp: np.ndarray
    hashes: np.ndarray  # uint64 [n, 2]
    where: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # pack row, packs side


def padded_fingerprints(rows: dict, lengths: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    """uint64 [n, 2] of input rows in their padded [n, S] / [n, P] layout, read in place
    (no compaction): per hash, the sum over the first `lengths` tokens of
    (token*2 + segment + 1) * W[position], plus the sum over the first `predictions`
    masked-LM slots of ((position << 32) + label + 1) * W'[slot]."""
    s, p = rows["input_ids"].shape[1], rows["masked_lm_positions"].shape[1]
    with np.errstate(over="ignore"):  # sums wrap modulo 2^64 by design
        # in place, a few passes over [n, S]: this is most of verify's input side
        token_value = rows["input_ids"].astype(np.uint64)
        token_value <<= np.uint64(1)
        token_value += rows["segment_ids"].astype(np.uint64)
        token_value += np.uint64(1)
        token_value *= (
            np.arange(s)[None, :] < lengths[:, None]
        )  # what lies past the length is not the sequence's
        slot_value = rows["masked_lm_positions"].astype(np.uint64)
        slot_value <<= np.uint64(32)
        slot_value += rows["masked_lm_ids"].astype(np.uint64)
        slot_value += np.uint64(1)
        slot_value *= np.arange(p)[None, :] < predictions[:, None]
        return token_value @ _INPUT_WEIGHTS[0][:s] + slot_value @ _INPUT_WEIGHTS[1][:p]


def pack_fingerprints(packs: dict, first_row: int = 0) -> Fingerprints:
    """The Fingerprints of every sequence in a block of packs, computed on the packed
    [p, S] layout (no extraction), in (pack, slot) order. The packs must keep the
    format's structure (packs.structure.first_malformed): each sequence a contiguous
    run starting at its next_sentence_positions entry, position_ids 0.. within it; and
    masked slots grouped by sequence (masked_slots_out_of_order)."""
    p, s = packs["sequence_ids"].shape
    k = packs["next_sentence_weights"].shape[1]
    present = packs["next_sentence_weights"] != 0  # [p, K]
    starts = packs["next_sentence_positions"].astype(np.int64)
    runs = present.sum(axis=1)
    real_tokens = np.count_nonzero(packs["sequence_ids"], axis=1)
    # sequence j ends where sequence j+1 starts; the last one where the real tokens end
    following = np.concatenate([starts[:, 1:], real_tokens[:, None]], axis=1)
    ends = np.where(np.arange(k)[None, :] + 1 < runs[:, None], following, real_tokens[:, None])
    ends = np.where(present, ends, starts)
    pack_index = np.arange(p)[:, None]
    with np.errstate(over="ignore"):  # sums wrap modulo 2^64 by design
        # tokens: (token*2 + segment + 1) * W[position within the sequence], summed per sequence as differences of a running sum along the pack (padding
        # lies past every sequence's end, so it never enters a sum)
        token_value = packs["input_ids"].astype(np.uint32)  # < 2^32: half the memory traffic of uint64
        token_value <<= np.uint32(1)
        token_value += packs["segment_ids"]
        token_value += np.uint32(1)
        positions = packs["position_ids"].astype(np.intp)
        hashes = np.empty((p, k, 2), dtype=np.uint64)
        running = np.zeros((p, s + 1), dtype=np.uint64)
        terms = np.empty((p, s), dtype=np.uint64)
        for h in range(2):
            np.take(_WEIGHTS[h, 0], positions, out=terms)
            terms *= token_value
            np.cumsum(terms, axis=1, out=running[:, 1:])
            hashes[:, :, h] = running[pack_index, ends] - running[pack_index, starts]
        # masked-LM slots, grouped by sequence in slot order (masked_slots_out_of_order):
        # each one's sequence, its position within it and its rank among that sequence's
        # slots (the input's slot order), summed per sequence like the tokens
        weights = packs["masked_lm_weights"]
        m = weights.shape[1]
        predictions = np.stack([np.count_nonzero(weights == j + 1, axis=1) for j in range(k)], axis=1)
        first = np.cumsum(predictions, axis=1) - predictions  # [p, K]: each sequence's first slot
        owner = np.clip(weights.astype(np.intp) - 1, 0, k - 1)
        used = weights > 0
        rank = np.arange(m)[None, :] - np.take_along_axis(first, owner, axis=1)
        rank[~used] = 0
        slot_value = packs["masked_lm_positions"].astype(np.int64) - np.take_along_axis(starts, owner, axis=1)
        slot_value = slot_value.astype(np.uint64)
        slot_value <<= np.uint64(32)
        slot_value += packs["masked_lm_ids"].astype(np.uint64)
        slot_value += np.uint64(1)
        slot_value *= used
        running = np.zeros((p, m + 1), dtype=np.uint64)
        for h in range(2):
            terms = _WEIGHTS[h, 1][rank]
            terms *= slot_value
            np.cumsum(terms, axis=1, out=running[:, 1:])
            hashes[:, :, h] += running[pack_index, first + predictions] - running[pack_index, first]
    rows, slots = np.nonzero(present)
    return Fingerprints(
        packs["source_index"][rows, slots].astype(np.int64),
        (ends - starts)[rows, slots],
        predictions[rows, slots].astype(np.int64),
        packs["next_sentence_labels"][rows, slots].astype(np.int64),
        hashes[rows, slots],
        rows + first_row,
    )


@dataclass(frozen=True)
class InputPieceTask:
    """Fingerprint rows [start, stop) of input `file_index` (global rows from source_start)."""

    file_index: int
    start: int
    stop: int
    source_start: int
    limits: Limits


@dataclass(frozen=True)
class ShardCheckTask:
    dataset: PackedDataset
    shard: int


def masked_slots_out_of_order(packs: dict) -> int | None:
    """The first pack whose masked-LM slots are not grouped by sequence in slot order
    with the unused ones last (the order `pack` writes, which pack_fingerprints reads),
    or None."""
    weights = packs["masked_lm_weights"].astype(np.int16)
    step = np.diff(weights, axis=1)
    later = weights[:, 1:] > 0
    bad = ((step < 0) & later).any(axis=1) | ((weights[:, :-1] == 0) & later).any(axis=1)
    rows = np.flatnonzero(bad)
    return int(rows[0]) if rows.size else None


def _input_piece(task: InputPieceTask):
    start, stop, source_start, limits = task.start, task.stop, task.source_start, task.limits
    source = worker_source(task.file_index)
    parts, problems = [], 0
    for a in range(start, stop, READ_ROWS):
        block = source.read(a, min(stop, a + READ_ROWS))
        for c in range(0, len(block["input_ids"]), CHUNK_ROWS):
            rows = {name: values[c : c + CHUNK_ROWS] for name, values in block.items()}
            lengths, predictions, problem = validate_rows(rows, limits, source.path, a + c)
            keep = np.ones(len(lengths), dtype=bool)
            keep[[r - a - c for r, _, _ in problem]] = False  # invalid rows: pack skips them, so verify does
            problems += len(problem)
            hashes = padded_fingerprints(rows, lengths, predictions)
            parts.append(
                Fingerprints(
                    source_start + a + c + np.flatnonzero(keep),
                    lengths[keep].astype(np.int64),
                    predictions[keep].astype(np.int64),
                    rows["next_sentence_labels"][keep].astype(np.int64),
                    hashes[keep],
                )
            )
    return _concat(parts), problems


def _pack_shard(task: ShardCheckTask):
    dataset, shard = task.dataset, task.shard
    parts, error = [], None
    path = dataset.shard_path(shard)
    for a, block in dataset.blocks(shard):
        for c in range(0, len(block["input_ids"]), CHUNK_ROWS // 2):
            packs = {name: values[c : c + CHUNK_ROWS // 2] for name, values in block.items()}
            malformed = first_malformed(packs)  # the structure pack_fingerprints relies on
            unordered = masked_slots_out_of_order(packs) if malformed is None else None
            if unordered is not None:
                malformed = (unordered, "masked-LM slots are not grouped by sequence in slot order")
            if malformed is not None:
                error = f"{path.name}: pack {a + c + malformed[0]}: {malformed[1]}"
                break
            parts.append(pack_fingerprints(packs, a + c))
        if error:
            break
    digest = sha256_file(path)
    return _concat(parts), error, digest


def _concat(parts: list[Fingerprints]) -> Fingerprints:
    if not parts:
        return Fingerprints(*(np.zeros(0, dtype=np.int64) for _ in range(4)), np.zeros((0, 2), np.uint64))
    return Fingerprints(
        *(
            np.concatenate([getattr(p, name) for p in parts])
            for name in ("source", "lengths", "predictions", "nsp")
        ),
        np.concatenate([p.hashes for p in parts]),
        np.concatenate([p.where for p in parts]),
    )


def run_verify(inputs: list[Path], packed: Path, workers: int = 1, quiet: bool = False, out=None) -> int:
    """Compare inputs and packs; print counts. Returns 0 if identical, 1 on any mismatch.

    Phases, each a function: fingerprint every input sequence and read every pack
    (structure, sha256, fingerprints), in one worker pool; presence (each expected sequence exactly once); content (every
    packed copy equal to its input); the report."""
    started = time.perf_counter()
    dataset = PackedDataset.open(packed)
    meta = dataset.metadata
    limits = Limits(meta["S"], meta.get("P", 1 << 15), meta.get("vocab_size"))
    sources = [open_source(p) for p in inputs]
    for source in sources:
        check_source_shape(source, limits)
    starts = np.cumsum([0] + [s.rows for s in sources])
    bar = dict(disable=quiet, unit="seq", unit_scale=True, file=sys.stderr, dynamic_ncols=True)
    expected, invalid_inputs, found, shard_of, problems = _fingerprints(
        dataset, packed, sources, starts, limits, workers, bar
    )
    located = _Locator(sources, starts, dataset, found, shard_of)
    presence = _presence(expected, found, int(starts[-1]))
    matched, mismatch = _content(expected, found, int(starts[-1]))
    problems += located.presence_problems(presence) + located.content_problems(matched, mismatch)
    seconds = time.perf_counter() - started
    n = int(starts[-1])
    changed_count = int(np.logical_or.reduce(list(mismatch.values())).sum())
    report = {
        "input_sequences": n,
        "invalid_input_rows": invalid_inputs,
        "skipped_by_pack": int(len(_skipped_sources(dataset))),
        "packed_sequences": int(found.source.size),
        "packs": dataset.packs,
        "shards": len(dataset.shards),
        "exactly_once": presence["exactly_once"],
        "missing": int(presence["missing"].size),
        "duplicated": int(presence["duplicated"].size),
        "unexpected": int(presence["unexpected"].size),
        "changed": changed_count,
        "unknown_source": presence["unknown"],
        "seconds": round(seconds, 3),
        "sequences_per_second": round(n / seconds, 1) if seconds else None,
        "ok": not problems and changed_count == 0,
    }
    out = out or sys.stdout
    print(json.dumps(report), file=out)
    for line in problems[:50]:
        print(f"MISMATCH {line}", file=out)
    return 0 if report["ok"] else 1


def _fingerprints(
    dataset: PackedDataset, packed: Path, sources, starts, limits: Limits, workers: int, bar: dict
):
    """Both sides in one worker pool, shards first (the larger tasks), so that no worker
    waits between the sides: (fingerprints of every valid input sequence, count of
    invalid input rows, fingerprints of every packed sequence, the shard each lies in,
    problems: a malformed pack, a shard whose sha256 differs from metadata.json)."""
    shard_tasks = [ShardCheckTask(dataset, d) for d in range(len(dataset.shards))]
    input_tasks = [
        InputPieceTask(f, a, min(s.rows, a + PIECE_ROWS), int(starts[f]), limits)
        for f, s in enumerate(sources)
        for a in range(0, s.rows, PIECE_ROWS)
    ]

    def moved(task, result) -> int:  # sequences a finished task accounts for
        return result[0].source.size if isinstance(task, ShardCheckTask) else task.stop - task.start

    total = dataset.sequences + int(starts[-1])
    with tqdm(total=total, desc="verify: packs and inputs", **bar) as progress:
        results = run_tasks(_verify_task, shard_tasks + input_tasks, workers, sources, progress, moved)
    shard_results, input_results = results[: len(shard_tasks)], results[len(shard_tasks) :]
    expected = _concat([r[0] for r in input_results])
    invalid_inputs = sum(r[1] for r in input_results)
    problems: list[str] = []
    for task, (_, error, digest) in zip(shard_tasks, shard_results):
        d = task.shard
        if error:
            problems.append(f"malformed pack: {error}")
        if digest != dataset.shards[d].get("sha256"):
            problems.append(
                f"{dataset.shards[d]['name']}: sha256 differs from (or is missing in) {packed}/metadata.json"
            )
    found = _concat([r[0] for r in shard_results])
    shard_of = np.concatenate(
        [np.full(r[0].source.size, t.shard) for t, r in zip(shard_tasks, shard_results)] or [[]]
    )
    return expected, invalid_inputs, found, shard_of, problems


def _verify_task(task):
    return _pack_shard(task) if isinstance(task, ShardCheckTask) else _input_piece(task)


def _presence(expected, found, n: int) -> dict:
    """Each expected sequence exactly once: counts per source index and the exceptions."""
    present = np.zeros(n, dtype=bool)
    present[expected.source] = True
    in_range = (found.source >= 0) & (found.source < n)
    counts = np.bincount(found.source[in_range], minlength=n)
    return {
        "counts": counts,
        "exactly_once": int(((counts == 1) & present).sum()),
        "duplicated": np.flatnonzero(counts > 1),
        "missing": np.flatnonzero(present & (counts == 0)),  # skipped rows are not valid inputs: not expected
        "unexpected": np.flatnonzero(~present & (counts > 0)),
        "unknown": int((~in_range).sum()),
    }


def _content(expected, found, n: int) -> tuple[np.ndarray, dict]:
    """Every packed copy against its input: (the packed index of each copy whose source is
    a valid input [matched], {what: bool [matched] where that field differs})."""
    in_range = (found.source >= 0) & (found.source < n)
    lookup = np.full(n, -1, dtype=np.int64)
    lookup[expected.source] = np.arange(expected.source.size)
    j = np.where(in_range, lookup[np.clip(found.source, 0, max(n - 1, 0))], -1)
    ok = j >= 0
    jj = j[ok]
    return np.flatnonzero(ok), {
        "length": found.lengths[ok] != expected.lengths[jj],
        "masked-LM count": found.predictions[ok] != expected.predictions[jj],
        "NSP label": found.nsp[ok] != expected.nsp[jj],
        "tokens/segments/masked-LM content": (found.hashes[ok] != expected.hashes[jj]).any(axis=1),
    }


class _Locator:
    """Names a sequence by its input file and row, and a packed copy by its shard and pack."""

    def __init__(self, sources, starts, dataset, found, shard_of):
        self.sources, self.starts, self.dataset, self.found, self.shard_of = (
            sources,
            starts,
            dataset,
            found,
            shard_of,
        )

    def source(self, index: int) -> str:
        f = int(np.searchsorted(self.starts, index, side="right") - 1)
        return f"sequence {index} ({self.sources[f].path} row {index - int(self.starts[f])})"

    def packed(self, i: int) -> str:
        return f"{self.dataset.shards[int(self.shard_of[i])]['name']} pack {int(self.found.where[i])}"

    def presence_problems(self, presence: dict) -> list[str]:
        problems, counts = [], presence["counts"]
        for s in presence["duplicated"][:5].tolist():
            places = ", ".join(self.packed(i) for i in np.flatnonzero(self.found.source == s)[:3])
            problems.append(f"duplicated: {self.source(s)} appears {counts[s]} times ({places})")
        for s in presence["missing"][:5].tolist():
            problems.append(f"missing: {self.source(s)} is in no pack")
        for s in presence["unexpected"][:5].tolist():
            problems.append(f"unexpected: {self.source(s)} is packed but is not a valid input sequence")
        if presence["unknown"]:
            n = counts.size
            problems.append(f"{presence['unknown']} packed sequences carry a source_index outside 0..{n - 1}")
        return problems

    def content_problems(self, matched: np.ndarray, mismatch: dict) -> list[str]:
        problems = []
        for what, bad in mismatch.items():
            for i in matched[np.flatnonzero(bad)[:3]].tolist():
                problems.append(
                    f"changed {what}: {self.source(int(self.found.source[i]))} in {self.packed(i)}"
                )
        return problems


def _skipped_sources(dataset: PackedDataset) -> np.ndarray:
    path = dataset.folder / SKIPPED
    if not dataset.metadata.get("skipped_rows") or not path.is_file():
        return np.zeros(0, dtype=np.int64)
    return np.array(
        [json.loads(line)["source_index"] for line in path.read_text().splitlines()], dtype=np.int64
    )
