"""Sequence packing for transformers: histograms, the packing algorithms (NNLSHP, SPFHP, LPFHP,
LP at the LP bound), plans and their exactly-once assignment, packed and unpacked shards,
verification. Pure numpy/scipy: never imports torch, model/ or any room above it.

from packing import Histogram, pack
plan = pack(Histogram.from_json_file("wikipedia_512.json"), "lp", 3)
plan.efficiency, plan.packing_factor
"""

from packing.algorithms import ALGORITHMS, pack
from packing.errors import PackingBugError, PackingInputError
from packing.histogram import Histogram
from packing.plan import PackingPlan, parse_max_sequences_per_pack

__all__ = [
    "ALGORITHMS",
    "Histogram",
    "PackingBugError",
    "PackingInputError",
    "PackingPlan",
    "pack",
    "parse_max_sequences_per_pack",
]
