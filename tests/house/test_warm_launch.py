"""The warm launcher (tests/warm_launch.py, tests/warm_zygote.py) gives a command forked from
its server what a fresh interpreter gives it: the same output, exit code, death by a signal,
session and process group, descriptors, arguments, search path, environment and signal
dispositions. Each case runs tests/warm_probe.py both ways and compares; `PACKED_TESTS_COLD`
in a command's environment starts it cold."""

import json
import os
import signal
import subprocess
import sys

import pytest

from .. import warm_launch
from ..conftest import REPO

PROBE = str(REPO / "tests" / "warm_probe.py")
pytestmark = pytest.mark.skipif(
    warm_launch.server_pid() is None, reason="the warm launcher is off (PACKED_TESTS_COLD)"
)


def both(argv, **options):
    """The command started warm, then cold: (warm, cold) CompletedProcess, each with .state
    (the probe's JSON line, or None)."""
    done = {}
    for way in ("warm", "cold"):
        env = (
            dict(options.pop("env", None) or os.environ)
            if way == "warm"
            else dict(done["env"], PACKED_TESTS_COLD="1")
        )
        done["env"] = env
        before = warm_launch.counts["warm"]
        result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120,
                                **options)  # fmt: skip
        assert warm_launch.counts["warm"] == before + (way == "warm"), way
        first = result.stdout.split("\n", 1)[0]
        result.state = json.loads(first) if first.startswith("{") else None
        done[way] = result
    return done["warm"], done["cold"]


def test_a_bench_scripts_own_python_commands_start_warm_too():
    """A bench script times commands of its own; a script the server forked from bench/ (here
    the probe, PACKED_TESTS_NESTED=1) gets a socket to the server, and its Python commands
    start warm as the test process's do, with their exit code; one it starts cold does not
    inherit the socket."""
    env = dict(os.environ, PACKED_TESTS_NESTED="1")
    for way, preloaded in (("warm", ["torch", "transformers"]), ("cold", [])):
        done = subprocess.run([sys.executable, PROBE, "spawn", "4", way], capture_output=True, text=True, env=env,
                              timeout=120)  # fmt: skip
        lines = done.stdout.splitlines()
        assert done.returncode == 0 and lines[2] == "returned 4", done.stderr
        assert json.loads(lines[0])["preloaded"] == ["torch", "transformers"]  # the probe itself: warm
        assert json.loads(lines[1])["preloaded"] == preloaded, way
        if way == "cold":
            assert json.loads(lines[1])["fds"] == []  # the socket closed at the exec


def test_a_warm_command_sees_its_process_as_a_cold_one_does(tmp_path):
    read, write = os.pipe()
    try:
        warm, cold = both([PROBE, "exit", "3", "stdin"], cwd=tmp_path, input="given on stdin", pass_fds=[write],
                          start_new_session=True, env=dict(os.environ, PROBE_VALUE="seen", PYTHONPATH=str(tmp_path)))  # fmt: skip
    finally:
        os.close(read)
        os.close(write)
    assert warm.returncode == cold.returncode == 3
    assert warm.stderr == cold.stderr == "to stderr\n"
    assert cold.state["preloaded"] == [] and warm.state["preloaded"] == ["torch", "transformers"]
    for state in (warm.state, cold.state):
        assert state["pid"] == state["pgid"] == state["sid"]  # a session of its own, as asked
        state.pop("pid"), state.pop("pgid"), state.pop("sid"), state.pop("preloaded")
    assert warm.state == cold.state
    assert (
        cold.state["fds"] == [write]
        and cold.state["env"] == "seen"
        and cold.state["path"][1] == str(tmp_path)
    )


def test_without_a_session_of_its_own_a_warm_command_stays_in_its_callers_group():
    warm, cold = both([PROBE, "exit", "0"])
    for done in (warm, cold):
        assert done.state["sid"] == os.getsid(0) and done.state["pgid"] == os.getpgid(0)


@pytest.mark.parametrize("action, code", [("raise", 1), ("interrupt", -signal.SIGINT), ("exit", 0)])
def test_a_warm_command_ends_as_a_cold_one_does(action, code):
    warm, cold = both([PROBE, action, "0"])
    assert warm.returncode == cold.returncode == code
    assert warm.stderr == cold.stderr  # the same traceback: the command's frames only
    assert warm.stdout.count("\n") == cold.stdout.count("\n") == 1


def test_an_ignored_signal_is_ignored_in_a_warm_command_as_in_a_cold_one(tmp_path):
    """What exec keeps: a signal the launching process ignores stays ignored in its child (a
    background run's SIGINT), and CPython then leaves SIGINT alone; the warm child gets the same."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        warm, cold = both([PROBE, "exit", "0"], cwd=tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert cold.state["sigint"] == str(signal.SIG_IGN.value)
    assert [warm.state[k] for k in ("sigint", "sigterm", "sigpipe")] == [
        cold.state[k] for k in ("sigint", "sigterm", "sigpipe")
    ]


@pytest.mark.parametrize("sent, code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_a_warm_command_dies_of_a_signal_as_a_cold_one_does(sent, code):
    for way, env in (("warm", os.environ), ("cold", dict(os.environ, PACKED_TESTS_COLD="1"))):
        process = subprocess.Popen([sys.executable, "-u", PROBE, "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env, start_new_session=True)  # fmt: skip
        assert json.loads(process.stdout.readline())["pid"] == process.pid, way
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)
        assert process.poll() is None
        os.killpg(process.pid, sent)
        assert process.wait(timeout=30) == code, way
        process.stdout.close(), process.stderr.close()


def test_a_module_command_runs_warm_with_the_same_output():
    warm, cold = both(["-m", "packed_transformers", "embed", "--help"], cwd=REPO)
    assert warm.returncode == cold.returncode == 0
    assert warm.stdout == cold.stdout and "embed" in warm.stdout


def test_what_asks_for_a_fresh_interpreter_starts_cold():
    for argv, env, why in (
        (["-X", "importtime", PROBE, "exit", "0"], os.environ, "cold: -X"),
        (["-c", "print(1)"], os.environ, "cold: -c"),
        ([PROBE, "exit", "0"], dict(os.environ, PYTHONHASHSEED="3"), "cold: environment PYTHONHASHSEED"),
        ([PROBE, "exit", "0"], dict(os.environ, HF_HUB_OFFLINE="0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"), "cold: environment HF_HUB_OFFLINE"),
    ):  # fmt: skip
        before = warm_launch.counts[why]
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0 and warm_launch.counts[why] == before + 1, (argv, done.stderr)
