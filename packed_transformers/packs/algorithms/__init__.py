"""Packing algorithms: `pack(histogram, algorithm, K) -> PackingPlan`, verified.

| name     | what                                                    | level     |
|----------|---------------------------------------------------------|-----------|
| none     | one sequence per pack (the unpacked baseline)           | histogram |
| spfhp    | shortest-pack-first histogram packing (Krell et al.)    | histogram |
| lpfhp    | longest-pack-first histogram packing (Krell et al.)     | histogram |
| nnlshp   | non-negative least squares, K <= 3 (Krell et al.)       | histogram |
| lp       | cutting-stock LP by column generation + integer repair  | histogram |
| bfd      | best-fit decreasing (baseline for the report)           | histogram |
| greedy   | next-fit in random arrival order (baseline, T5/GPT-like)| sequence  |
"""

from __future__ import annotations

import time

from packed_transformers.packs.algorithms.baselines import greedy_next_fit, no_packing
from packed_transformers.packs.algorithms.heuristics import best_fit_decreasing, lpfhp, spfhp
from packed_transformers.packs.algorithms.lp import lp_pack
from packed_transformers.packs.algorithms.nnlshp import nnlshp
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import MaxPerPack, PackingPlan, effective_depth

ALGORITHMS = {
    "none": no_packing,
    "spfhp": spfhp,
    "lpfhp": lpfhp,
    "nnlshp": nnlshp,
    "lp": lp_pack,
    "bfd": best_fit_decreasing,
    "greedy": greedy_next_fit,
}
# What `report` compares by default, and what a production `pack` may use.
PRODUCTION_ALGORITHMS = ("none", "spfhp", "lpfhp", "nnlshp", "lp")
BASELINE_ALGORITHMS = ("bfd", "greedy")


def pack(histogram: Histogram, algorithm: str, max_sequences_per_pack: MaxPerPack) -> PackingPlan:
    """Run `algorithm` on `histogram` with at most K sequences per pack (None = unlimited).

    The returned plan has been verified: it packs every sequence of the histogram exactly
    once, within N tokens and K sequences per pack. `seconds` is the solve time.
    """
    if algorithm not in ALGORITHMS:
        raise PackingInputError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    if max_sequences_per_pack is not None and max_sequences_per_pack < 1:
        raise PackingInputError(f"max sequences per pack must be >= 1, got {max_sequences_per_pack}")
    depth = effective_depth(max_sequences_per_pack, histogram.max_sequence_length)
    start = time.perf_counter()
    result = ALGORITHMS[algorithm](histogram, depth)
    seconds = time.perf_counter() - start
    pairs, extra = result if isinstance(result, tuple) else (result, {})
    plan = PackingPlan.from_pairs(
        algorithm, histogram, max_sequences_per_pack, pairs, seconds=seconds, extra=extra
    )
    return plan.verify(histogram)


__all__ = ["ALGORITHMS", "PRODUCTION_ALGORITHMS", "BASELINE_ALGORITHMS", "pack"]
