"""Packing for tokenized datasets held in memory (fine-tuning, inference).

Pretraining data goes through shards on disk (packing/, the shard packer); a fine-tuning set is a
list of token id lists that fits in memory. The same histogram algorithms pack it:

    table = pack_examples(lengths, max_tokens=128, max_per_pack=None, algorithm="lpfhp", seed=0)

max_per_pack None chooses K from the lengths (fitting_depth); an integer is a limit.

`table` [packs, K] holds example indices (-1 = empty slot), so every output of a pack can
be sent back to the example it came from (fine-tuning's rows are built and read back from
it in packs/rows.py). Every example is in exactly one slot (checked). Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packed_transformers.packs.algorithms import pack
from packed_transformers.packs.errors import PackingBugError, PackingInputError
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import assign_sequences

# The depths a default K is chosen from (fitting_depth): a few, so that the rows' [packs, K]
# fields take few shapes.
DEPTH_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEPTH_TOLERANCE = 0.005  # padding (a fraction of the row tokens) a shallower K may leave beyond the deepest


def padding_of(counts: np.ndarray, max_tokens: int, max_per_pack: int) -> float:
    """The padding fraction LPFHP's plan leaves with `max_per_pack`: histogram-level, fast."""
    plan = pack(Histogram(counts), "lpfhp", max_per_pack)
    tokens = int(np.dot(counts, np.arange(1, len(counts) + 1)))
    return 1.0 - tokens / (int(plan.counts.sum()) * max_tokens)


def fitting_depth(lengths: np.ndarray, max_tokens: int) -> int:
    """K chosen from the length histogram: the smallest of DEPTH_LADDER whose plan leaves at
    most DEPTH_TOLERANCE more padding than the deepest (short texts in wide rows get a deep
    K; 300-token texts in 512-token rows get 2 or 3). LPFHP's plans decide (each a few ms);
    the packing itself then runs the algorithm asked for at that K."""
    counts = np.bincount(np.asarray(lengths, dtype=np.int64) - 1, minlength=max_tokens)
    ladder = [k for k in DEPTH_LADDER if k <= max_tokens] or [1]
    floor = padding_of(counts, max_tokens, ladder[-1])
    return next(k for k in ladder if padding_of(counts, max_tokens, k) <= floor + DEPTH_TOLERANCE)


# Padding (a fraction of the row tokens) above which a packed run is told of wider packs.
WIDER_PACKS_WORTH = 0.02


@dataclass(frozen=True)
class WiderPacks:
    """Packs of `pack_length` tokens would leave `padding` (a fraction of the row tokens)."""

    pack_length: int
    padding: float


def wider_packs(lengths: np.ndarray, width: int, current: float) -> WiderPacks | None:
    """Packs twice as wide as `width`, where the width in use leaves more than
    WIDER_PACKS_WORTH padding and the wider ones would leave at most half of it; else None.
    Examples near the cut (documents truncated at max_sequence_length) fill one pack each at
    that width and pair up only in wider packs, which position ids restarting in every
    sequence allow (bench/bench_padding_ceiling.py: BBC articles cut at 512 tokens, 10.8%
    padding in packs of 512, 0.5% in packs of 1,024). A pure decision; nothing is changed."""
    if current <= WIDER_PACKS_WORTH:
        return None
    wider = 2 * width
    counts = np.bincount(np.asarray(lengths, dtype=np.int64) - 1, minlength=wider)
    padding = padding_of(counts, wider, fitting_depth(lengths, wider))
    return WiderPacks(wider, padding) if padding <= current / 2 else None


def pack_examples(
    lengths: np.ndarray, max_tokens: int, max_per_pack: int | None, algorithm: str, seed: int
) -> np.ndarray:
    """int64 [packs, K] of example indices into `lengths` (-1 = empty slot), packs in random
    order (seeded); K = the plan's deepest pack (at most max_per_pack; None: fitting_depth of
    the lengths). lengths: int [n], tokens per example, each in 1..max_tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0:
        raise PackingInputError(f"expected a non-empty 1-D array of lengths, got shape {lengths.shape}")
    bad = np.flatnonzero((lengths < 1) | (lengths > max_tokens))
    if bad.size:
        i = int(bad[0])
        raise PackingInputError(
            f"example {i} has {lengths[i]} tokens; expected 1..{max_tokens} "
            f"({bad.size} examples out of range)"
        )
    if max_per_pack is None:
        max_per_pack = fitting_depth(lengths, max_tokens)
        if algorithm == "nnlshp":  # its strategies grow as N^(K-1): it packs at most 3
            max_per_pack = min(max_per_pack, 3)
    counts = np.bincount(lengths - 1, minlength=max_tokens)
    plan = pack(Histogram(counts), algorithm, max_per_pack)
    # K = the deepest pack of the plan, not the limit asked for: every [packs, K] field and
    # every per-slot computation (a classifier's last layer, pooler, head) scales with K,
    # and a limit of 8 where packs hold at most 3 would do 8/3 times that work for nothing.
    table = assign_sequences(plan, lengths, seed, min(max_per_pack, plan.max_depth))
    check_table(table, lengths.size)
    return table


def check_table(table: np.ndarray, n: int) -> None:
    """Raise unless `table` holds every index 0..n-1 exactly once (and -1 elsewhere)."""
    used = table[table >= 0]
    if used.size != n or not np.array_equal(np.sort(used), np.arange(n)):
        raise PackingBugError(f"pack table holds {used.size} slots for {n} examples, not each exactly once")


def pack_with_places(
    lengths: np.ndarray, max_tokens: int, max_per_pack: int | None, algorithm: str, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """pack_examples' table, and each example's place among its slots flattened: int64 [n],
    pack * K + slot (a contrastive step reads each text's pooled vector there)."""
    table = pack_examples(lengths, max_tokens, max_per_pack, algorithm, seed)
    flat = table.reshape(-1)
    place = np.empty(len(lengths), dtype=np.int64)
    place[flat[flat >= 0]] = np.flatnonzero(flat >= 0)
    return table, place
