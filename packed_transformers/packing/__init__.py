"""The offline packer of MLPerf shards (`python -m packed_transformers.packing` / `packed pack`):
unpacked HDF5 shards in, a static-shape packed dataset out, every sequence exactly once,
verified; the shards' format, sources, the parallel pipeline, unpacking, reports. The
algorithms, histograms and plans it runs live one floor down in packs/ and are re-exported
here. Pure numpy/scipy/h5py: never imports torch, model/ or any room above it.

from packed_transformers.packing import Histogram, pack
plan = pack(Histogram.from_json_file("wikipedia_512.json"), "lp", 3)
plan.efficiency, plan.packing_factor
"""

from packed_transformers.packs import (
    ALGORITHMS,
    Histogram,
    PackingBugError,
    PackingInputError,
    PackingPlan,
    pack,
    parse_max_sequences_per_pack,
)

__all__ = [
    "ALGORITHMS",
    "Histogram",
    "PackingBugError",
    "PackingInputError",
    "PackingPlan",
    "pack",
    "parse_max_sequences_per_pack",
]
