"""The fifth hostile test (issue: reliability 5): outputs that would replace what is not a
regular file, an admission estimate that locked out a legal request, and the cases after
them. Each test fails without its fix."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from common.files import atomic_folder, atomic_path, output_file, output_over_inputs
from serving.admission import ADMIT_WITHIN, MeasuredRates, bucket_of, refusal

from .conftest import REPO


# ----- 1. outputs go only to a regular file or a new path -------------------------------------
def test_a_fifo_device_or_directory_is_refused_and_left_as_it_is(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, kind in [(fifo, "a FIFO"), ("/dev/null", "a character device"), (tmp_path, "a directory")]:
        assert kind in output_over_inputs(path)
        with pytest.raises(OSError, match="regular file|a directory"), atomic_path(path) as tmp:
            tmp.write_text("x")
    assert fifo.is_fifo() and os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]  # no temporary file left


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "real.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    assert output_file(link) == target.resolve()
    with atomic_path(link) as tmp:
        tmp.write_text("new")
    assert link.is_symlink() and target.read_text() == "new"
    to_device = tmp_path / "null"
    to_device.symlink_to("/dev/null")
    with pytest.raises(OSError, match="character device"), atomic_path(to_device) as tmp:
        tmp.write_text("x")
    assert to_device.is_symlink()


def test_a_folder_output_over_a_file_or_device_is_refused(tmp_path):
    plain = tmp_path / "file"
    plain.write_text("keep")
    for path in (plain, "/dev/null"):
        with pytest.raises(OSError, match="not a folder"), atomic_folder(path):
            pass
    assert plain.read_text() == "keep" and not os.path.isfile("/dev/null")


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "data.train_vocab", "--input", "{text}", "--output", "{out}"],
        ["-m", "finetune.embed", "--model", "{text}", "--input", "{text}", "--output", "{out}"],
        ["-m", "finetune.predict", "--model", "{text}", "--input", "{text}", "--output", "{out}"],
    ],
)
def test_commands_refuse_a_device_or_fifo_output_in_one_line(tmp_path, command):
    text = tmp_path / "in.txt"
    text.write_text("some words here\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for out in (fifo, "/dev/null"):
        argv = [a.format(text=text, out=out) for a in command]
        done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "regular file" in lines[0], done.stderr
    assert fifo.is_fifo()


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

    from serving.metrics import ServerMetrics
    from serving.policies import PolicySettings
    from serving.scheduler import QueueLimits, Scheduler

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
