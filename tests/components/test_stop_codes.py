"""How a pretraining run stopped by a signal exits (reliability 9, item 2): 128 + the signal,
130 for Ctrl-C as docs/failure_behaviour.md says, 143 for SIGTERM; it exited 143 for both."""

from __future__ import annotations

import os
import signal

import pytest

from packed_transformers.components.run_state import StopSignal, interrupted_exit_code


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_by_a_signal_exits_128_plus_it(signum, code):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopSignal()
        assert interrupted_exit_code() == 143  # no signal here: another replica's stop (SIGTERM's code)
        os.kill(os.getpid(), signum)
        assert stop.requested and interrupted_exit_code() == code
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not change what stopped the run
        assert interrupted_exit_code() == code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_the_first_stop_signal_is_answered_at_once(capsys):
    """Issue 108 item 8: Ctrl-C during a long contrastive step under load went unanswered for
    30 s; the run now says at once that it stops after this step (once, however many signals)."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        StopSignal()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        err = capsys.readouterr().err
        assert err.strip().splitlines() == ["SIGINT: stopping after this step, then keeping a checkpoint"], (
            err
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
