"""Sequence packing for transformers: histograms, the packing algorithms (NNLSHP, SPFHP, LPFHP,
LP at the LP bound), plans and their exactly-once assignment, packed and unpacked shards,
verification. Pure numpy/scipy: never imports torch, model/ or any room above it.

from packed_transformers.packing import Histogram, pack
plan = pack(Histogram.from_json_file("wikipedia_512.json"), "lp", 3)
plan.efficiency, plan.packing_factor
"""

from packed_transformers.packing.algorithms import ALGORITHMS, pack
from packed_transformers.packing.errors import PackingBugError, PackingInputError
from packed_transformers.packing.histogram import Histogram
from packed_transformers.packing.plan import PackingPlan, parse_max_sequences_per_pack

__all__ = [
    "ALGORITHMS",
    "Histogram",
    "PackingBugError",
    "PackingInputError",
    "PackingPlan",
    "pack",
    "parse_max_sequences_per_pack",
]
