"""The LP packer's plans and bytes do not depend on the machine's load: identical under load and
without, and twice over."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import REPO
from ..folder_helpers import one_line_error, run_module, tiny_hub_classifier  # noqa: F401


# ----- packing reproducible to the byte, on any machine speed ------------------------------------
def busy_cores(n: int):
    """n processes spinning on the CPU (the load a shared CI machine has)."""
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


@pytest.mark.slow
def test_lp_plans_are_the_same_under_load_and_without():
    """The residual integer program is limited in HiGHS nodes, not seconds: a plan (and so
    the packed bytes) cannot depend on how fast the machine ran that day."""
    from packed_transformers.packs.algorithms.lp import lp_pack
    from packed_transformers.packs.histogram import Histogram

    histogram = Histogram.from_json_file(
        REPO / "packed_transformers" / "packing" / "histograms" / "wikipedia_512.json"
    )
    quiet, _ = lp_pack(histogram, 3)
    spinners = busy_cores(1)  # a core busy beside the suite's two workers (more only slows the other worker)
    try:
        loaded, _ = lp_pack(histogram, 3)
    finally:
        for p in spinners:
            p.kill()
    assert sorted(quiet) == sorted(loaded)


@pytest.mark.slow
def test_the_lp_packer_gives_identical_bytes_twice_one_run_under_load(tmp_path):
    from packed_transformers.data.synthetic import write_synthetic_shards
    from packed_transformers.packing.cli import main as packing_main

    from ..packing_helpers import P, S, small_counts

    write_synthetic_shards(tmp_path / "in", small_counts(), sequences=3000, rows_per_file=1100, seed=7, p=P)
    args = ["pack", "--input", f"{tmp_path}/in/*.h5", "--max-sequence-length", S, "--max-predictions-per-seq",
            P, "--algorithm", "lp", "--max-sequences-per-pack", 3, "--quiet", "--output"]  # fmt: skip
    assert packing_main([str(a) for a in [*args, tmp_path / "a"]]) == 0
    spinners = busy_cores(4)
    try:
        assert packing_main([str(a) for a in [*args, tmp_path / "b"]]) == 0
    finally:
        for p in spinners:
            p.kill()
    shards = sorted(p.name for p in (tmp_path / "a").glob("part-*.h5"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "b").glob("part-*.h5"))
    for shard in shards:
        assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
