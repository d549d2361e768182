"""How sequences become packs: length histograms, the packing algorithms (NNLSHP, SPFHP, LPFHP,
LP at the LP bound), plans and their exactly-once assignment, a pack's structure rules,
tokenized examples packed for fine-tuning and inference, the batch tables both run on
(batching) and their rows (rows), causal-LM rows (lm_rows/), the
unpacked HDF5 shard layout and the worker pool. Pure numpy/scipy (h5py inside the functions
that write files): never imports torch, model/, packing/ (the MLPerf shard packer built on
this room) or any room above it.

from packed_transformers.packs import Histogram, pack
plan = pack(Histogram.from_json_file("wikipedia_512.json"), "lp", 3)
plan.efficiency, plan.packing_factor
"""

from packed_transformers.packs.algorithms import ALGORITHMS, pack
from packed_transformers.packs.errors import PackingBugError, PackingInputError
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import PackingPlan, parse_max_sequences_per_pack

__all__ = [
    "ALGORITHMS",
    "Histogram",
    "PackingBugError",
    "PackingInputError",
    "PackingPlan",
    "pack",
    "parse_max_sequences_per_pack",
]
