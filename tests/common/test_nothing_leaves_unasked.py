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
import time

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
        ready, said = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: Python code running when the signal comes; a handler that returned exits 7
            os.write(said, b"1")  # CPython clears signals that arrive before fork() returns in the child
            for _ in range(1000):
                time.sleep(0.01)
            os._exit(7)
        assert os.read(ready, 1) == b"1"
        os.close(ready), os.close(said)
        os.kill(pid, signal.SIGTERM)
        for _ in range(2000):  # at most 20 s, then the child is killed and the test fails
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not end on SIGTERM")
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        assert called == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


ORT_SESSION = """
import sys
if sys.argv[1] == "ours":
    import packed_transformers.inference.onnx_session  # what every ONNX Runtime path of ours imports first
import onnxruntime
from onnx import TensorProto, helper
value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1])
graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [value("x")], [value("y")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
"""


ORT_QUIET_UNDER = (
    "CI",
    "TF_BUILD",
    "GITHUB_ACTIONS",
    "GITLAB_CI",
    "CIRCLECI",
    "TRAVIS",
    "JENKINS_URL",
    "CODEBUILD_BUILD_ID",
    "BUILDKITE",
    "TEAMCITY_VERSION",
    "APPVEYOR",
    "BITBUCKET_BUILD_NUMBER",
)


def test_onnxruntime_keeps_and_sends_nothing(tmp_path):
    """ONNX Runtime 1.32's Linux wheel keeps a device id and an event store under
    ~/.cache/Microsoft/DeveloperTools/.onnxruntime and sends them to Microsoft's collector unless
    ORT_DISABLE_TELEMETRY is set: our processes set it before onnxruntime is imported."""
    pytest.importorskip("onnxruntime")
    # a user's shell, not a CI runner's: ONNX Runtime stays silent where any of these is set (the
    # names are read from its library's strings), and it keeps its store under XDG_CACHE_HOME when set
    env = {k: v for k, v in os.environ.items() if k not in ORT_QUIET_UNDER + ("XDG_CACHE_HOME", "ORT_DISABLE_TELEMETRY",
                                                             "PACKED_TRANSFORMERS_ONNXRUNTIME_TELEMETRY")}  # fmt: skip
    homes = {}
    for who in ("ours", "theirs"):
        homes[who] = tmp_path / who
        homes[who].mkdir()
        done = subprocess.run([sys.executable, "-c", ORT_SESSION, who], capture_output=True, text=True, timeout=120,
                              env={**env, "HOME": str(homes[who])})  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    assert list(homes["ours"].rglob("*")) == []
    # the test can fail: without the switch ONNX Runtime writes its device id and event store
    assert (homes["theirs"] / ".cache/Microsoft/DeveloperTools/.onnxruntime").is_dir()
