"""The one evaluation schedule (components.run_state.EvalSchedule, issue 95): by samples it
evaluates once each time the samples trained pass a multiple of its interval, however many
samples a step adds (BERT's steps, the decoder's rows), and never at interval 0; per epoch at the
epoch's last batch only."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from packed_transformers.components.run_state import EvalSchedule


@given(every=st.integers(1, 50), steps=st.lists(st.integers(1, 120), max_size=40))
def test_by_samples_it_evaluates_once_per_interval_crossed(every, steps):
    schedule = EvalSchedule(every)
    state = SimpleNamespace(samples=0, next_eval_samples=schedule.first())
    evaluations = 0
    for samples in steps:
        before = state.samples
        state.samples += samples
        due = schedule.claim(state)
        # due exactly when a multiple of `every` lies in (before, now]; the next point is the first after now
        assert due == (state.samples // every > before // every)
        assert state.next_eval_samples == (state.samples // every + 1) * every
        evaluations += due
    assert evaluations <= state.samples // every


@given(steps=st.lists(st.integers(1, 100), max_size=20))
def test_interval_zero_never_evaluates(steps):
    state = SimpleNamespace(samples=0, next_eval_samples=0)
    for samples in steps:
        state.samples += samples
        assert not EvalSchedule(0).claim(state)
    assert state.next_eval_samples == 0


def test_per_epoch_it_evaluates_at_the_epochs_last_batch_only():
    schedule = EvalSchedule(per_epoch=True)
    state = SimpleNamespace(samples=0, next_eval_samples=0)
    assert not schedule.claim(state, None)  # no epoch in progress
    seen = [schedule.claim(state, (done, 5)) for done in range(1, 6)]
    assert seen == [False, False, False, False, True]
