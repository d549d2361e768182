"""Assignment: which sequence goes into which slot of which pack.

A plan says how many packs hold which lengths; the assignment turns it into a table
[packs, K] of global sequence indices (-1 for empty slots). It is deterministic for a
seed, puts the packs in random order, and uses every sequence exactly once (MLPerf's
rule): sequences of each length are drawn in a random order, and the i-th slot of
length L (in pack order) gets the i-th drawn sequence of length L.

Memory: a few int64 arrays the size of the dataset (the "index arrays"), nothing per token.
"""

from __future__ import annotations

import numpy as np

from packing.errors import PackingBugError
from packing.plan import PackingPlan


def assign_sequences(plan: PackingPlan, lengths: np.ndarray, seed: int, width: int) -> np.ndarray:
    """Table int64 [packs, width] of global sequence indices, -1 for empty slots.

    lengths: int [n], length of every sequence (-1 or 0 marks a skipped row, never assigned).
    Slots within a pack hold the plan's strategy order (longest first).
    """
    rng = np.random.default_rng(seed)
    strategy_of_pack = np.repeat(np.arange(len(plan.strategies)), plan.counts)
    strategy_of_pack = strategy_of_pack[rng.permutation(strategy_of_pack.size)]
    table = np.full((strategy_of_pack.size, width), -1, dtype=np.int64)
    slot_lengths = np.zeros((len(plan.strategies), width), dtype=np.int64)
    for i, strategy in enumerate(plan.strategies):
        if len(strategy) > width:
            raise PackingBugError(f"strategy {strategy} is deeper than the table width {width}")
        slot_lengths[i, : len(strategy)] = strategy
    slot_len = slot_lengths[strategy_of_pack]  # [packs, width], 0 = empty slot
    filled = slot_len > 0
    wanted = slot_len[filled]  # row-major: pack order, then slot order

    order = rng.permutation(lengths.size)
    valid = lengths[order] > 0
    order = order[valid]
    by_length = order[np.argsort(lengths[order], kind="stable")]  # random order within a length
    if by_length.size != wanted.size:
        raise PackingBugError(f"plan has {wanted.size} slots for {by_length.size} sequences")
    sources = np.empty_like(by_length)
    sources[np.argsort(wanted, kind="stable")] = by_length
    if not np.array_equal(lengths[sources], wanted):
        raise PackingBugError("assignment put a sequence into a slot of another length")
    table[filled] = sources
    return table
