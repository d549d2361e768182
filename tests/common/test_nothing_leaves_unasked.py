"""Reliability 9, item 1: nothing leaves the machine unasked, and no library's child process
runs our signal handlers. OpenVINO's conversion sent usage events to Google Analytics from
child processes and wrote a client id under ~/intel; each terminated child ran the SIGTERM
handler it inherited from `packed embed` and printed a KeyboardInterrupt traceback.

The judge is OpenVINO's own telemetry package: its Google Analytics backend is replaced by
one that records every event it is asked to send, in a fresh process whose home is a
temporary folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from packed_transformers.common.cli import own_process_handler

CONVERT_WITH_A_RECORDING_BACKEND = """
import json, os, sys
from pathlib import Path
sent = []
try:
    from openvino_telemetry.backend import backend_ga4
    def record(self, message):
        sent.append(str(message)[:80])
    backend_ga4.GA4Backend.send = record
except ImportError:
    pass
if sys.argv[1] == "ours":
    import packed_transformers.inference.openvino_graphs  # what every OpenVINO path of ours imports first
import torch, openvino
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
openvino.convert_model(model, example_input=torch.ones(1, 4))
from openvino_telemetry.utils.opt_in_checker import OptInChecker
print(json.dumps({"sent": sent, "consent": OptInChecker().check(False, False).name,
                  "home": sorted(p.name for p in Path.home().iterdir())}))
"""


def converted(tmp_path, who: str) -> dict:
    home = tmp_path / who
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL",
                                                             "PACKED_TRANSFORMERS_OPENVINO_TELEMETRY")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", CONVERT_WITH_A_RECORDING_BACKEND, who], capture_output=True,
                          text=True, timeout=300, env={**env, "HOME": str(home)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_openvino_sends_nothing_and_writes_nothing_in_home(tmp_path):
    pytest.importorskip("openvino_telemetry")
    ours = converted(tmp_path, "ours")
    assert ours == {"sent": [], "consent": "DECLINED", "home": []}
    # the test can fail: the same conversion without our opt-out would send (consent by default)
    theirs = converted(tmp_path, "theirs")
    assert theirs["consent"] != "DECLINED"


def test_a_user_who_asks_for_openvino_telemetry_gets_its_own_rules(monkeypatch):
    pytest.importorskip("openvino_telemetry")
    from packed_transformers.common import telemetry

    monkeypatch.setenv(telemetry.OPENVINO_TELEMETRY_VARIABLE, "1")
    assert telemetry.decline_openvino_telemetry() is False


def test_a_child_forked_later_dies_by_the_signal_not_by_our_handler():
    """A library's child (forked after our handler was installed) that gets SIGTERM ends by
    SIGTERM's default action; the parent's handler still runs in the parent."""
    called = []
    previous = signal.signal(signal.SIGTERM, own_process_handler(lambda signum, frame: called.append(signum)))
    try:
        pid = os.fork()
        if pid == 0:  # the child: wait for the signal; a handler that returned would exit 7
            signal.pause()
            os._exit(7)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        assert called == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
