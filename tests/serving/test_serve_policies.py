"""The server's batching policies and its queue, without HTTP: properties over random queues,
TEI's FIFO rule, starvation, deadlines, admission limits and draining on stop."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_transformers.serving.api import RequestError, RequestLimits, parse_predict, parse_qa
from packed_transformers.serving.metrics import ServerMetrics
from packed_transformers.serving.policies import POLICIES, PolicySettings, plan_batch
from packed_transformers.serving.scheduler import QueueFull, QueueLimits, Scheduler, TicketFailed

queues = st.lists(st.integers(1, 512), min_size=1, max_size=300).map(lambda v: np.array(v, dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(lengths=queues, policy=st.sampled_from(POLICIES), budget=st.sampled_from([512, 2048, 16384]))
def test_every_plan_runs_each_chosen_sequence_once_within_its_row(lengths, policy, budget):
    rng = np.random.default_rng(len(lengths))
    waited = np.sort(rng.uniform(0, 0.3, size=len(lengths)))[::-1]  # arrival order: oldest first
    config = PolicySettings(policy, max_batch_tokens=budget, max_length=512, batch_size=8, pad_to=128)
    plan = plan_batch(lengths, waited, config)
    assert len(plan.chosen) >= 1 and len(set(plan.chosen.tolist())) == len(plan.chosen)
    slots = plan.table[plan.table >= 0]
    assert sorted(slots.tolist()) == list(range(len(plan.chosen)))  # each chosen one exactly once
    for row in plan.table:
        assert lengths[plan.chosen[row[row >= 0]]].sum() <= plan.width
    if policy == "packed":
        if len(plan.chosen) == 1:  # one sequence runs at its own length
            assert plan.width == lengths[plan.chosen[0]]
        else:
            assert plan.width in {*config.widths} or plan.width % 16 == 0
        # the budget holds unless one sequence alone exceeds it
        assert lengths[plan.chosen].sum() <= budget or len(plan.chosen) == 1
        overdue = np.flatnonzero(waited >= config.starve_after_s)
        if lengths[overdue].sum() <= budget:
            assert set(overdue.tolist()) <= set(plan.chosen.tolist())  # the starving go first
    if policy == "fifo-tokens":
        n = len(plan.chosen)
        assert plan.chosen.tolist() == list(range(n))  # first come, first served
        assert plan.width == lengths[:n].max()
        assert n == 1 or plan.width * n <= budget
        if n < len(lengths):  # TEI's rule: the next one would break the budget
            assert max(plan.width, lengths[n]) * (n + 1) > budget
    if policy == "padded":
        assert plan.chosen.tolist() == list(range(min(8, len(lengths))))
        assert plan.width == max(128, lengths[plan.chosen].max())


def test_packed_takes_the_longest_first_and_fills_rows():
    lengths = np.array([10, 120, 30, 100, 20, 60])
    config = PolicySettings("packed", max_batch_tokens=260, max_length=128, widths=(128,))
    plan = plan_batch(lengths, np.zeros(6), config)
    assert plan.chosen.tolist() == [1, 3]  # longest first: 120, 100; + 60 = 280 breaks 260
    # once the 10-token one has waited past starve_after_s it goes first
    waited = np.array([0.2, 0, 0, 0, 0, 0])
    assert plan_batch(lengths, waited, config).chosen.tolist() == [0, 1, 3]
    # a light queue: rows as tight as the longest (rounded up to 16), not the fixed 128;
    # a lone sequence at its own length
    light = plan_batch(np.array([40, 23]), np.zeros(2), config)
    assert (light.width, sorted(light.table.tolist())) == (48, [[0], [1]])
    lone = plan_batch(np.array([40]), np.zeros(1), config)
    assert (lone.width, lone.table.tolist()) == (40, [[0]])


class EchoEngine:
    """Returns each sequence's length; optionally slow, to hold the worker."""

    task = "classification"

    def __init__(self, seconds=0.0):
        self.seconds, self.batches = seconds, []

    def run(self, token_ids, segment_ids, table, width):
        time.sleep(self.seconds)
        self.batches.append(len(token_ids))
        return [len(t) for t in token_ids]


def run_async(coroutine):
    return asyncio.run(coroutine)


def test_answers_come_back_in_request_order_and_the_queue_refuses_beyond_its_bound():
    async def scenario():
        engine = EchoEngine(0.05)
        scheduler = Scheduler(
            engine, PolicySettings("packed", max_length=512), QueueLimits(10, 0, 30), ServerMetrics()
        )
        scheduler.start()
        first = scheduler.submit([np.zeros(n) for n in (5, 9, 7)], [None] * 3)
        second = scheduler.submit([np.zeros(n) for n in (3, 4, 8, 1, 2, 6)], [None] * 6)
        with pytest.raises(QueueFull):
            scheduler.submit([np.zeros(4)] * 5, [None] * 5)  # 9 may be queued: 5 more exceed 10
        answers = [await first.future, await second.future]
        scheduler.stop()
        return answers

    assert run_async(scenario()) == [[5, 9, 7], [3, 4, 8, 1, 2, 6]]


def test_a_request_past_its_deadline_gets_504_and_its_sequences_never_run():
    async def scenario():
        engine = EchoEngine(0.3)
        scheduler = Scheduler(engine, PolicySettings("fifo-tokens", max_length=512, max_batch_tokens=512),
                              QueueLimits(100, 0, 0.1), ServerMetrics())  # fmt: skip
        scheduler.start()
        busy = scheduler.submit([np.zeros(300)], [None])  # holds the worker for 0.3 s
        await asyncio.sleep(0.05)
        late = scheduler.submit([np.zeros(300)], [None])  # its deadline passes while queued
        await busy.future
        with pytest.raises(TicketFailed) as failed:
            await late.future
        scheduler.stop()
        return failed.value.status, engine.batches

    status, batches = run_async(scenario())
    assert status == 504 and batches == [1]


def test_stop_answers_everything_queued_then_refuses():
    async def scenario():
        engine = EchoEngine(0.02)
        scheduler = Scheduler(
            engine, PolicySettings("padded", max_length=512, batch_size=1), QueueLimits(), ServerMetrics()
        )
        scheduler.start()
        tickets = [scheduler.submit([np.zeros(i + 1)], [None]) for i in range(10)]
        stopper = threading.Thread(target=scheduler.stop)
        stopper.start()
        results = [await t.future for t in tickets]
        stopper.join()
        with pytest.raises(QueueFull):
            scheduler.submit([np.zeros(3)], [None])
        return results

    assert run_async(scenario()) == [[i + 1] for i in range(10)]


@pytest.mark.parametrize(
    "inputs, expected, single",
    [
        ("a", [("a", None)], True),
        (["a", "b"], [("a", "b")], True),  # TEI: a list that starts with a string is one pair
        (["a"], [("a", None)], True),
        ([["a"], ["b", "c"]], [("a", None), ("b", "c")], False),
    ],
)
def test_predict_requests_read_as_tei_reads_them(inputs, expected, single):
    sequences, is_single, truncate, raw = parse_predict({"inputs": inputs}, RequestLimits())
    assert (sequences, is_single, truncate, raw) == (expected, single, False, False)


@pytest.mark.parametrize(
    "data, status, says",
    [
        ({"inputs": ["a", "b", "c"]}, 422, "a pair has 2"),
        ({"inputs": [["a"], "b"]}, 422, "inputs[1]"),
        ({"inputs": []}, 422, "expected a string"),
        ({"inputs": [["a"]] * 33}, 413, "at most 32"),
        ({"inputs": "x" * 100_001}, 413, "characters"),
        ({"inputs": "a", "raw_scores": 1}, 422, "raw_scores"),
    ],
)
def test_bad_predict_requests_are_named(data, status, says):
    with pytest.raises(RequestError) as err:
        parse_predict(data, RequestLimits())
    assert err.value.status == status and says in err.value.message


def test_qa_requests():
    one = {"question": "q?", "context": "c."}
    assert parse_qa({"inputs": one}, RequestLimits()) == ([one], True)
    assert parse_qa({"inputs": [one, one]}, RequestLimits()) == ([one, one], False)
    for bad in ({"question": "q"}, {"question": "q", "context": " "}, [{"question": 1, "context": "c"}]):
        with pytest.raises(RequestError):
            parse_qa({"inputs": bad}, RequestLimits())


def test_admission_refuses_what_the_measured_rate_cannot_run_before_the_timeout():
    """429 at admission instead of a 504 later: once the worker has measured its tokens/s at
    the batch size the queue runs in, a request whose queue would take over half the timeout
    is refused (serving/admission.py)."""

    async def scenario():
        engine = EchoEngine(0.05)  # any batch in 0.05 s: 500 tokens at 10,000 tokens/s
        scheduler = Scheduler(engine, PolicySettings("fifo-tokens", max_length=512, max_batch_tokens=512),
                              QueueLimits(10_000, 0, 0.2), ServerMetrics())  # fmt: skip
        scheduler.start()
        await scheduler.submit([np.zeros(100)] * 5, [None] * 5).future  # measures a full batch
        admitted, refused = [], 0
        for _ in range(40):  # 40 x 100 tokens: 0.4 s of work; half the 0.2 s timeout is 0.1 s
            try:
                admitted.append(scheduler.submit([np.zeros(100)], [None]))
            except QueueFull:
                refused += 1
        statuses = []
        for ticket in admitted:
            try:
                await ticket.future
                statuses.append(200)
            except TicketFailed as err:
                statuses.append(err.status)
        scheduler.stop()
        return statuses, refused

    statuses, refused = run_async(scenario())
    assert refused > 0 and 5 <= len(statuses) <= 15
    assert statuses == [200] * len(statuses)  # everything admitted ran before its deadline
