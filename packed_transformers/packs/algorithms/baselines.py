"""Reference points that are not histogram packers: one sequence per pack, and
greedy concatenation in arrival order (next-fit), as T5/GPT-style pipelines do."""

from __future__ import annotations

import numpy as np

from packed_transformers.packs.histogram import Histogram


def no_packing(histogram: Histogram, depth: int):
    """One sequence per pack: the unpadded baseline every speed-up is measured against."""
    return [((length,), int(c)) for length, c in enumerate(histogram.counts.tolist(), 1) if c]


def greedy_next_fit(histogram: Histogram, depth: int, seed: int = 0):
    """Concatenate sequences in a random arrival order (seeded); start a new pack when the
    next sequence does not fit or the pack holds `depth` sequences. Sequence-level, so it
    takes O(sequences) Python steps: a baseline for the report, not a production packer."""
    rng = np.random.default_rng(seed)
    lengths = np.repeat(histogram.lengths, histogram.counts)
    rng.shuffle(lengths)
    n = histogram.max_sequence_length
    pairs: dict[tuple[int, ...], int] = {}
    current: list[int] = []
    used = 0
    for length in lengths.tolist():
        if used + length > n or len(current) == depth:
            key = tuple(current)
            pairs[key] = pairs.get(key, 0) + 1
            current, used = [], 0
        current.append(length)
        used += length
    key = tuple(current)
    pairs[key] = pairs.get(key, 0) + 1
    return list(pairs.items())
