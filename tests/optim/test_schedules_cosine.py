"""WarmupCosineDecay (optim/schedules.py): the decoder run's schedule, in optim/ with the
other schedules (it lived in the decoder loop): the rules' shape, checked point by point."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from packed_transformers.optim import WarmupCosineDecay

SCHEDULE = WarmupCosineDecay(peak_lr=1e-3, warmup_samples=100, total_samples=1100, end_lr=1e-4)


def test_points_of_the_schedule():
    assert SCHEDULE(0) == 1e-3 / 100  # the first step trains at a rate above zero
    assert SCHEDULE(99) == 1e-3
    assert SCHEDULE(100) == 1e-3  # the cosine starts at the peak
    assert math.isclose(SCHEDULE(600), 0.5 * (1e-3 + 1e-4))  # halfway down
    assert math.isclose(SCHEDULE(1100), 1e-4) and SCHEDULE(5000) == SCHEDULE(1100)


@given(st.integers(0, 2000), st.integers(0, 2000))
def test_warmup_rises_and_the_cosine_falls(a, b):
    lo, hi = sorted((a, b))
    if hi < 100:
        assert SCHEDULE(lo) <= SCHEDULE(hi)
    if lo >= 100:
        assert SCHEDULE(lo) >= SCHEDULE(hi) >= 1e-4 - 1e-18
