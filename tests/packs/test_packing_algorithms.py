"""Property tests (hypothesis) and hand-worked cases for every packing algorithm."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packed_transformers.packing import (
    ALGORITHMS,
    Histogram,
    PackingBugError,
    PackingInputError,
    PackingPlan,
    pack,
)
from packed_transformers.packs.plan import remove_excess


@st.composite
def histograms_and_depths(draw):
    n = draw(st.integers(min_value=1, max_value=48))
    counts = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    if sum(counts) == 0:
        counts[draw(st.integers(0, n - 1))] = draw(st.integers(1, 40))
    k = draw(st.one_of(st.none(), st.integers(1, 6)))
    return Histogram(np.array(counts, dtype=np.int64)), k


def _check_plan(plan: PackingPlan, histogram: Histogram, k):
    # Conservation: every sequence exactly once.
    assert np.array_equal(plan.length_counts(), histogram.counts)
    depth = histogram.max_sequence_length if k is None else k
    for strategy, count in zip(plan.strategies, plan.counts):
        assert count >= 1
        assert sum(strategy) <= histogram.max_sequence_length  # capacity
        assert 1 <= len(strategy) <= depth  # depth
        assert list(strategy) == sorted(strategy, reverse=True)
    # No packing can beat the token and depth lower bounds.
    assert plan.packs >= math.ceil(histogram.real_tokens / histogram.max_sequence_length)
    assert plan.packs >= math.ceil(histogram.sequences / depth)
    assert 0 < plan.efficiency <= 1
    assert plan.sequences == histogram.sequences and plan.real_tokens == histogram.real_tokens


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=histograms_and_depths())
def test_conservation_capacity_depth(algorithm, case):
    histogram, k = case
    depth = histogram.max_sequence_length if k is None else min(k, histogram.max_sequence_length)
    if algorithm == "nnlshp" and depth > 3:
        with pytest.raises(PackingInputError, match="at most 3"):
            pack(histogram, algorithm, k)
        return
    _check_plan(pack(histogram, algorithm, k), histogram, k)


@settings(max_examples=60, deadline=None)
@given(case=histograms_and_depths())
def test_lp_never_below_its_own_bound_and_close_to_it(case):
    histogram, k = case
    plan = pack(histogram, "lp", k)
    bound = plan.extra["lp_bound_packs"]
    assert plan.packs >= math.ceil(bound - 1e-6)
    # The LP bound is also a bound for every other algorithm.
    for other in ("spfhp", "lpfhp", "bfd"):
        assert pack(histogram, other, k).packs >= math.ceil(bound - 1e-6)


def h(n, pairs):
    counts = np.zeros(n, dtype=np.int64)
    for length, count in pairs.items():
        counts[length - 1] = count
    return Histogram(counts)


def as_dict(plan):
    return dict(zip(plan.strategies, plan.counts.tolist()))


def test_hand_worked_complements():
    # Lengths 6,6,2,2 in packs of 8: two full packs (6,2) for the best-fit packers.
    histogram = h(8, {6: 2, 2: 2})
    for algorithm in ("lpfhp", "spfhp", "bfd", "lp", "nnlshp"):
        assert as_dict(pack(histogram, algorithm, 2)) == {(6, 2): 2}, algorithm
    assert as_dict(pack(histogram, "none", 2)) == {(6,): 2, (2,): 2}


def test_hand_worked_spfhp_vs_lpfhp():
    # N=10: 6 x1, 4 x1, 3 x2. 6 -> (6); 4 -> (6,4), full, closed. SPFHP places all
    # sequences of one length at once, so both 3s open packs of their own; LPFHP's
    # "distribute" puts as many copies as fit into one new pack: (3,3).
    histogram = h(10, {6: 1, 4: 1, 3: 2})
    spf = as_dict(pack(histogram, "spfhp", None))
    lpf = as_dict(pack(histogram, "lpfhp", None))
    assert spf == {(6, 4): 1, (3,): 2}
    assert lpf == {(6, 4): 1, (3, 3): 1}
    # With K=1 nothing may share a pack.
    assert pack(histogram, "lpfhp", 1).packs == 4


def test_lpfhp_distributes_repeats():
    # 5 sequences of length 100, N=512: LPFHP puts all 5 into one pack (repeat), K=max.
    assert as_dict(pack(h(512, {100: 5}), "lpfhp", None)) == {(100,) * 5: 1}
    # K=3 caps the repeat: one pack of 3 and one of 2.
    assert as_dict(pack(h(512, {100: 5}), "lpfhp", 3)) == {(100,) * 3: 1, (100,) * 2: 1}


def test_spfhp_prefers_emptiest_pack():
    # N=10: lengths 7 and 5 open two packs (space 3 and 5); a 3 goes to the emptiest (5).
    plan = pack(h(10, {7: 1, 5: 1, 3: 1}), "spfhp", None)
    assert as_dict(plan) == {(7,): 1, (5, 3): 1}
    # LPFHP is best fit: the 3 goes where it fits exactly.
    assert as_dict(pack(h(10, {7: 1, 5: 1, 3: 1}), "lpfhp", None)) == {(7, 3): 1, (5,): 1}


def test_greedy_is_next_fit_in_arrival_order():
    plan = pack(h(10, {9: 3}), "greedy", None)
    assert as_dict(plan) == {(9,): 3}
    plan = pack(h(10, {5: 4}), "greedy", None)
    assert as_dict(plan) == {(5, 5): 2}


def test_unlimited_depth_reaches_token_bound_when_lengths_divide():
    plan = pack(h(512, {1: 512 * 3}), "lp", None)
    assert as_dict(plan) == {(1,) * 512: 3}


def test_verify_rejects_bad_plans():
    histogram = h(10, {5: 2})
    good = PackingPlan.from_pairs("x", histogram, 2, [((5, 5), 1)])
    good.verify(histogram)
    with pytest.raises(PackingBugError, match="length 5"):
        PackingPlan.from_pairs("x", histogram, 2, [((5,), 1)]).verify(histogram)
    with pytest.raises(PackingBugError, match="> N=10"):
        PackingPlan.from_pairs("x", h(10, {6: 2}), 2, [((6, 6), 1)]).verify(h(10, {6: 2}))
    with pytest.raises(PackingBugError, match="> K=1"):
        PackingPlan.from_pairs("x", histogram, 1, [((5, 5), 1)]).verify(histogram)


def test_remove_excess_drops_phantoms_without_adding_packs():
    histogram = h(10, {5: 1, 3: 2})
    # An over-covering plan: (5,5) x1 and (3,3) x1 covers 5 twice.
    pairs = remove_excess([((5, 5), 1), ((3, 3), 1)], histogram)
    plan = PackingPlan.from_pairs("x", histogram, 2, pairs).verify(histogram)
    assert plan.packs == 2


def test_bad_arguments():
    with pytest.raises(PackingInputError, match="unknown algorithm"):
        pack(h(4, {1: 1}), "magic", 2)
    with pytest.raises(PackingInputError, match=">= 1"):
        pack(h(4, {1: 1}), "lpfhp", 0)
