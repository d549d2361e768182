"""Efficiency regression on the published histograms: at least the published figures
(docs/packing.md, measured). Never asserts time: speed lives in bench/."""

import pytest

from packed_transformers.packing import Histogram, pack

from ..conftest import HISTOGRAMS

WIKIPEDIA = [  # (algorithm, K, published efficiency)
    ("spfhp", 2, 0.8052),
    ("spfhp", 3, 0.8944),
    ("spfhp", 4, 0.9394),
    ("spfhp", 8, 0.9890),
    ("spfhp", 12, 0.9960),
    ("lpfhp", 2, 0.8055),
    ("lpfhp", 3, 0.8949),
    ("lpfhp", 4, 0.9396),
    ("lpfhp", 8, 0.9911),
    ("lpfhp", 12, 0.9981),
    # NNLSHP on the Wikipedia histogram: ~12 s, in `make test` only (SQuAD's case stays in the fast loop)
    pytest.param("nnlshp", 3, 0.99750, marks=pytest.mark.slow),
    # Ours: within 0.01 percentage points of the LP bound (0.99884 at K=3, 0.99983 at K>=4).
    # the LP packer on the Wikipedia histogram: ~9 s each, so in `make test`, not the fast loop
    pytest.param("lp", 3, 0.99874, marks=pytest.mark.slow),
    pytest.param("lp", None, 0.99973, marks=pytest.mark.slow),
]
SQUAD = [
    ("spfhp", 3, 0.9755),
    ("lpfhp", 3, 0.9774),
    ("nnlshp", 3, 0.9739),
    ("lp", 3, 0.98791),
    ("lp", None, 0.98791),
]


@pytest.fixture(scope="module")
def wikipedia():
    return Histogram.from_json_file(HISTOGRAMS / "wikipedia_512.json")


@pytest.fixture(scope="module")
def squad():
    return Histogram.from_json_file(HISTOGRAMS / "squad_384.json")


def test_histogram_figures(wikipedia, squad):
    assert wikipedia.sequences == 16_279_552
    assert wikipedia.padding_fraction_unpacked == pytest.approx(0.5003, abs=1e-4)
    assert wikipedia.theoretical_speedup == pytest.approx(2.0013, abs=1e-4)
    assert squad.sequences == 88_641


@pytest.mark.parametrize("algorithm,k,published", WIKIPEDIA)
def test_wikipedia_at_least_published(wikipedia, algorithm, k, published):
    plan = pack(wikipedia, algorithm, k)
    assert round(plan.efficiency, 4 if published < 0.997 else 5) >= published


@pytest.mark.parametrize("algorithm,k,published", SQUAD)
def test_squad_at_least_published(squad, algorithm, k, published):
    assert pack(squad, algorithm, k).efficiency >= published - 5e-5


@pytest.mark.slow  # three LP solves, ~9 s
def test_lp_bound_matches_published_relaxation(wikipedia, squad):
    assert pack(wikipedia, "lp", 2).extra["lp_bound_efficiency"] == pytest.approx(0.80546, abs=1e-5)
    assert pack(wikipedia, "lp", 3).extra["lp_bound_efficiency"] == pytest.approx(0.99884, abs=1e-5)
    assert pack(squad, "lp", 3).extra["lp_bound_efficiency"] == pytest.approx(0.98801, abs=1e-5)
