"""The server's admission: what a batch of each size costs, learned from the batches it runs;
a full queue refused (429); small requests never lock out a large one; a burst on a cold
server refused rather than left to time out."""

from __future__ import annotations

import time

import numpy as np
import pytest

from packed_transformers.serving.admission import ADMIT_WITHIN, MeasuredRates, bucket_of, refusal

from ..folder_helpers import one_line_error, run_module, tiny_hub_classifier  # noqa: F401


# ----- 2. admission that a run of tiny batches cannot lock --------------------------------------
def tiny_then_large_rates():
    """What seven one-word requests teach: ~7 tokens in ~14 ms (500 tokens/s)."""
    rates = MeasuredRates()
    for _ in range(7):
        rates.observe(7, 0.014)
    return rates


def test_an_empty_queue_admits_whatever_was_measured():
    rates = tiny_then_large_rates()
    # 32 texts of ~400 tokens: 12,800 tokens, 25 s at the tiny batches' rate; timeout 30 s.
    assert refusal(0, 0, 32, 12_800, rates, 1024, 16_384, 30.0) is None


def test_an_estimate_from_small_batches_does_not_refuse_a_larger_batch():
    rates = tiny_then_large_rates()
    assert rates.rate_for(12_800) is None and rates.rate_for(8) == rates.rate_for(5) == rates.rate_for(15)
    assert refusal(1, 7, 32, 12_800, rates, 1024, 16_384, 30.0) is None


def test_the_rate_of_each_batch_size_decides_and_a_full_queue_is_refused():
    rates = MeasuredRates()
    rates.observe(16_000, 2.0)  # 8,000 tokens/s at full batches
    rates.observe(10, 0.02)  # 500 tokens/s for tiny ones
    assert bucket_of(16_000) == 13 and bucket_of(10) == 3
    # 100,000 tokens queued = 6 full batches + 1 of 1,696: ~12.5 s; within 0.5 x 30 s.
    assert refusal(5, 100_000, 1, 10, rates, 1024, 16_000, 30.0) is None
    reason = refusal(5, 200_000, 1, 10, rates, 1024, 16_000, 30.0)
    assert reason and "would take 25.0 s" in reason
    assert ADMIT_WITHIN * 30.0 < 25.0
    assert "the queue holds 1020 of 1024" in refusal(1020, 10, 5, 10, rates, 1024, 16_000, 30.0)


def test_a_bucket_learns_from_the_batches_it_runs():
    rates = MeasuredRates()
    for _ in range(40):
        rates.observe(4_000, 1.0)
    for _ in range(40):
        rates.observe(4_000, 0.5)  # the machine got faster: the average follows
    assert rates.rate_for(4_000) == pytest.approx(8_000, rel=1e-3)
    assert np.isclose(rates.seconds_for(8_000, 4_000), 1.0, rtol=1e-3)


class AffineEngine:
    """A model double whose forward costs a fixed 20 ms plus 0.5 ms per 1,000 tokens: the shape
    of a real CPU forward, where a one-word batch is mostly fixed cost."""

    task = "classification"

    def run(self, token_ids, segment_ids, table, width):
        import time

        time.sleep(0.02 + 5e-7 * sum(len(t) for t in token_ids))
        return [len(t) for t in token_ids]


def test_seven_tiny_requests_do_not_lock_out_a_large_one():
    """Reliability 5's reproduction through the scheduler: after seven one-word requests, a
    request of 32 x 400 tokens on an idle server is admitted and answered, every time."""
    import asyncio

    from packed_transformers.serving.metrics import ServerMetrics
    from packed_transformers.serving.policies import PolicySettings
    from packed_transformers.serving.scheduler import QueueLimits, Scheduler

    async def scenario():
        scheduler = Scheduler(
            AffineEngine(), PolicySettings("packed", max_length=512, max_batch_tokens=16_384),
            QueueLimits(1024, 0, 0.5), ServerMetrics(),
        )  # fmt: skip
        scheduler.start()
        answers = []
        for _ in range(7):
            answers.append(await scheduler.submit([np.zeros(3)], [None]).future)
        for _ in range(3):  # tiny batches measured ~150 tokens/s: 12,800 tokens "85 s" > 0.25 s
            answers.append(await scheduler.submit([np.zeros(400)] * 32, [None] * 32).future)
        scheduler.stop()
        return answers

    answers = asyncio.run(scenario())
    assert answers[:7] == [[3]] * 7 and answers[7:] == [[400] * 32] * 3


# ----- 12. a cold server bounds admission by a first measured estimate -----------------------------
class LinearEngine:
    """A model double: 10 ms plus 20 us per token (50,000 tokens/s at full batches); its
    first estimate (as serving/engines.py's engines give one) is a conservative 20,000."""

    task = "classification"

    def cold_tokens_per_second(self):
        return 20_000.0

    def run(self, token_ids, segment_ids, table, width):
        time.sleep(0.01 + 2e-5 * sum(len(t) for t in token_ids))
        return [len(t) for t in token_ids]


def test_a_burst_on_a_cold_server_is_refused_rather_than_left_to_time_out():
    """40 requests of 8 x 512 tokens at once, 1 s timeout: about 4 s of work. A cold server
    had no estimate, admitted them all and answered most with 504 after the wait; the engine's
    first estimate now refuses (429) what cannot run in time, and every admitted one answers."""
    import asyncio

    from packed_transformers.serving.metrics import ServerMetrics
    from packed_transformers.serving.policies import PolicySettings
    from packed_transformers.serving.scheduler import QueueFull, QueueLimits, Scheduler, TicketFailed

    async def scenario():
        scheduler = Scheduler(
            LinearEngine(), PolicySettings("packed", max_length=512, max_batch_tokens=4096),
            QueueLimits(1024, 0, 1.0), ServerMetrics(),
        )  # fmt: skip
        scheduler.start()
        admitted, refused = [], 0
        for _ in range(40):
            try:
                admitted.append(scheduler.submit([np.zeros(512)] * 8, [None] * 8).future)
            except QueueFull:
                refused += 1
        outcomes = []
        for future in admitted:
            try:
                outcomes.append(await future)
            except TicketFailed as failed:
                outcomes.append(failed.status)
        scheduler.stop()
        return refused, outcomes

    refused, outcomes = asyncio.run(scenario())
    assert refused >= 25, refused  # at most ~0.5 s of the 4 s admitted
    assert outcomes and all(o == [512] * 8 for o in outcomes), outcomes  # no 504 among the admitted
