"""Histogram heuristics from Krell et al., "Efficient Sequence Packing without
Cross-contamination" (2021): SPFHP and LPFHP, plus histogram best-fit decreasing.

All three walk the lengths from longest to shortest and place all sequences of
one length at once, moving whole groups of identical packs. They run in
milliseconds on a 16 M-sequence histogram because the work depends on N and on
the number of distinct strategies, not on the number of sequences.
"""

from __future__ import annotations

from packed_transformers.packs.algorithms.open_packs import OpenPacks
from packed_transformers.packs.histogram import Histogram


def spfhp(histogram: Histogram, depth: int):
    """Shortest-pack-first: each length goes into the open pack with the MOST space left
    (the shortest pack) that fits it, or starts new packs. Returns (strategy, count) pairs."""
    n = histogram.max_sequence_length
    packs = OpenPacks(n, depth)
    for length in range(n, 0, -1):
        remaining = int(histogram.counts[length - 1])
        while remaining > 0:
            space = packs.largest_space()
            if space is None or space < length:
                packs.place((length,), remaining)
                break
            available, strategy = packs.pop(space)
            moved = min(available, remaining)
            if available > moved:
                packs.push_back(space, available - moved, strategy)
            remaining -= moved
            packs.place(strategy + (length,), moved)
    return packs.all_pairs()


def lpfhp(histogram: Histogram, depth: int, distribute: bool = True):
    """Longest-pack-first: each length goes into the open pack with the LEAST space left
    that fits it (best fit); with `distribute`, as many copies of the length as fit and
    as the remaining count allows go in at once. Returns (strategy, count) pairs.

    With distribute=False this is best-fit decreasing on the histogram.
    """
    n = histogram.max_sequence_length
    packs = OpenPacks(n, depth)
    for length in range(n, 0, -1):
        remaining = int(histogram.counts[length - 1])
        while remaining > 0:
            space = packs.smallest_space_at_least(length)
            if space is None:
                # Nothing open fits: start packs holding `repeat` copies of this length.
                repeat = min(n // length, depth, remaining) if distribute else 1
                new_packs = remaining // repeat
                packs.place((length,) * repeat, new_packs)
                remaining -= new_packs * repeat
                continue
            available, strategy = packs.pop(space)
            repeat = min(space // length, depth - len(strategy), remaining) if distribute else 1
            moved = min(available, remaining // repeat)
            if available > moved:
                packs.push_back(space, available - moved, strategy)
            remaining -= moved * repeat
            packs.place(strategy + (length,) * repeat, moved)
    return packs.all_pairs()


def best_fit_decreasing(histogram: Histogram, depth: int):
    """Best-fit decreasing, one sequence at a time, run on the histogram (exactly what the
    sequence-level algorithm does, in O(N * strategies) instead of O(sequences))."""
    return lpfhp(histogram, depth, distribute=False)
