"""`PackingPlan`: which multisets of sequence lengths make up the packs, and how often.

A plan is histogram-level: it says "pack lengths (300, 200, 12) together 4,117
times", not which sequences go where (packs.plan does that). Every plan is
verified against its histogram before an algorithm returns it: each sequence is
packed exactly once, no pack exceeds N tokens or K sequences.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from packed_transformers.packs.errors import PackingBugError, PackingInputError
from packed_transformers.packs.histogram import Histogram

# K = None means "unlimited": any number of sequences per pack (at most N).
MaxPerPack = Optional[int]  # noqa: UP045 -- a runtime alias: `int | None` needs Python 3.10 (the IPU stack runs 3.8)


def parse_max_sequences_per_pack(value) -> MaxPerPack:
    """'max' / None / 'unlimited' -> None; an integer >= 1 -> itself."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("max", "unlimited")):
        return None
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise PackingInputError(
            f"max sequences per pack must be an integer >= 1 or 'max', got {value!r}"
        ) from None
    if isinstance(value, float) and value != k:
        raise PackingInputError(f"max sequences per pack must be an integer, got {value!r}")
    if k < 1:
        raise PackingInputError(f"max sequences per pack must be >= 1, got {k}")
    return k


def effective_depth(k: MaxPerPack, max_sequence_length: int) -> int:
    """The number of sequences a pack can hold at most: K, or N when unlimited."""
    return max_sequence_length if k is None else min(k, max_sequence_length)


@dataclass(frozen=True)
class PackingPlan:
    """Strategies (length tuples, sorted longest first) with repeat counts.

    strategies[i] is a tuple of real sequence lengths packed into one row;
    counts[i] >= 1 is how many rows use it. Lengths are in tokens.
    """

    algorithm: str
    max_sequence_length: int  # N, tokens per pack
    max_sequences_per_pack: MaxPerPack  # K, None = unlimited
    strategies: tuple[tuple[int, ...], ...]
    counts: np.ndarray  # int64 [len(strategies)]
    seconds: float = 0.0
    extra: dict = field(default_factory=dict, compare=False)  # algorithm diagnostics

    @classmethod
    def from_pairs(cls, algorithm, histogram, k, pairs, seconds=0.0, extra=None) -> PackingPlan:
        """Build a plan from (strategy, count) pairs: merges duplicates, drops zero counts."""
        merged: Counter = Counter()
        for strategy, count in pairs:
            count = int(count)
            if count < 0:
                raise PackingBugError(f"{algorithm}: negative count {count} for {strategy}")
            if count:
                merged[tuple(sorted((int(x) for x in strategy), reverse=True))] += count
        merged.pop((), None)  # packs emptied of every sequence are no packs at all
        strategies = tuple(sorted(merged))
        counts = np.array([merged[s] for s in strategies], dtype=np.int64)
        return cls(algorithm, histogram.max_sequence_length, k, strategies, counts, seconds, extra or {})

    # ----- metrics -------------------------------------------------------------------------
    @property
    def packs(self) -> int:
        return int(self.counts.sum())

    @property
    def sequences(self) -> int:
        return int(sum(c * len(s) for s, c in zip(self.strategies, self.counts.tolist())))

    @property
    def real_tokens(self) -> int:
        return int(sum(c * sum(s) for s, c in zip(self.strategies, self.counts.tolist())))

    @property
    def padding_tokens(self) -> int:
        return self.packs * self.max_sequence_length - self.real_tokens

    @property
    def efficiency(self) -> float:
        """Fraction (0..1) of the packed tokens that are real, not padding."""
        return self.real_tokens / (self.packs * self.max_sequence_length)

    @property
    def packing_factor(self) -> float:
        """Average sequences per pack."""
        return self.sequences / self.packs

    @property
    def theoretical_speedup(self) -> float:
        """N * sequences / real tokens: the upper bound any packing of this data can reach."""
        return self.max_sequence_length * self.sequences / self.real_tokens

    @property
    def strategies_used(self) -> int:
        return len(self.strategies)

    @property
    def max_depth(self) -> int:
        return max(len(s) for s in self.strategies)

    def length_counts(self) -> np.ndarray:
        """int64 [N]: how many sequences of each length the plan packs."""
        out = np.zeros(self.max_sequence_length, dtype=np.int64)
        for strategy, count in zip(self.strategies, self.counts.tolist()):
            for length in strategy:
                out[length - 1] += count
        return out

    def summary(self) -> dict:
        """The JSON contract of `python -m packed_transformers.packing report --json`."""
        return {
            "algorithm": self.algorithm,
            "max_sequence_length": self.max_sequence_length,
            "max_sequences_per_pack": (
                "max" if self.max_sequences_per_pack is None else self.max_sequences_per_pack
            ),
            "sequences": self.sequences,
            "packs": self.packs,
            "real_tokens": self.real_tokens,
            "padding_tokens": self.padding_tokens,
            "efficiency": self.efficiency,
            "packing_factor": self.packing_factor,
            "theoretical_speedup": self.theoretical_speedup,
            "strategies_used": self.strategies_used,
            "max_depth": self.max_depth,
            "seconds": self.seconds,
        }

    # ----- verification --------------------------------------------------------------------
    def verify(self, histogram: Histogram) -> PackingPlan:
        """Raise PackingBugError unless the plan packs exactly `histogram`; return self."""
        name, n = self.algorithm, self.max_sequence_length
        if n != histogram.max_sequence_length:
            raise PackingBugError(f"{name}: plan N={n} != histogram N={histogram.max_sequence_length}")
        if len(self.strategies) != len(self.counts):
            raise PackingBugError(f"{name}: {len(self.strategies)} strategies, {len(self.counts)} counts")
        depth = effective_depth(self.max_sequences_per_pack, n)
        for strategy, count in zip(self.strategies, self.counts.tolist()):
            if count < 1:
                raise PackingBugError(f"{name}: strategy {strategy} has count {count}")
            if not strategy or min(strategy) < 1:
                raise PackingBugError(f"{name}: invalid strategy {strategy}")
            if sum(strategy) > n:
                raise PackingBugError(f"{name}: strategy {strategy} holds {sum(strategy)} > N={n} tokens")
            if len(strategy) > depth:
                raise PackingBugError(
                    f"{name}: strategy {strategy} holds {len(strategy)} > K={depth} sequences"
                )
        packed = self.length_counts()
        if not np.array_equal(packed, histogram.counts):
            diff = np.flatnonzero(packed != histogram.counts)
            i = int(diff[0])
            raise PackingBugError(
                f"{name}: plan packs {packed[i]} sequences of length {i + 1}, histogram has "
                f"{histogram.counts[i]} ({diff.size} lengths differ)"
            )
        return self


def remove_excess(pairs, histogram: Histogram):
    """Take sequences out of (strategy, count) pairs until no length is over-covered.

    Relaxation-based packers (NNLS, LP) may cover a length more often than the
    histogram holds it. Removing the surplus copies from their packs keeps every
    pack valid (fewer tokens, fewer sequences) and never adds a pack; the result
    has no phantom "padding sequences". Returns a new list of (strategy, count).
    """
    pairs = [(tuple(s), int(c)) for s, c in pairs if c > 0]
    covered = np.zeros(histogram.max_sequence_length, dtype=np.int64)
    for s, c in pairs:
        for length in s:
            covered[length - 1] += c
    excess = covered - histogram.counts
    for length in (np.flatnonzero(excess > 0) + 1).tolist():
        surplus = int(excess[length - 1])
        i = 0
        while surplus > 0 and i < len(pairs):
            s, c = pairs[i]
            if length in s and c > 0:
                moved = min(c, surplus)
                trimmed = list(s)
                trimmed.remove(length)
                pairs[i] = (s, c - moved)
                pairs.append((tuple(trimmed), moved))
                surplus -= moved
                # the trimmed strategy may still hold `length` again: it is visited later
            i += 1
        if surplus:
            raise PackingBugError(f"could not remove {surplus} surplus sequences of length {length}")
    return [(s, c) for s, c in pairs if c > 0 and s]


# ----- assignment: which sequence goes into which slot of which pack --------------------
# Assignment: which sequence goes into which slot of which pack.
#
# A plan says how many packs hold which lengths; the assignment turns it into a table
# [packs, K] of global sequence indices (-1 for empty slots). It is deterministic for a
# seed, puts the packs in random order, and uses every sequence exactly once (MLPerf's
# rule): sequences of each length are drawn in a random order, and the i-th slot of
# length L (in pack order) gets the i-th drawn sequence of length L.
#
# Memory: a few int64 arrays the size of the dataset (the "index arrays"), nothing per token.
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
