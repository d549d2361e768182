"""Subprocesses that never outlive their test: each command runs in a process group of its
own (a new session), and whatever of that group is still alive when the command ends or
times out (a torchrun rank left waiting in gloo's rendezvous after its launcher died: one
was found running 50 minutes after the suite) is killed and reported as a failure.

Launches of several processes (torchrun) take one machine-wide lock, so that two of them
never share the two cores of a CI machine: a Trainer run over 2 ranks hung past its timeout
once while another test's 4 ranks ran beside it (CI, 2026-11-28). A command that times out
is sent SIGABRT first: with PYTHONFAULTHANDLER set, every Python process of the group writes
the stack of each of its threads to stderr, and the failure shows where it waited.

torchrun (torch 2.13) starts each rank in a session of its own (SubprocessHandler:
start_new_session=True), outside the command's group: a hung Trainer run showed only the
launcher's stacks, and its rank was found alive after the test (2026-11-29). So every process
a command starts carries a tag in its environment (RUN_TAG, inherited by whatever it starts in
turn), and the processes holding the tag are signalled, killed and reported with the group."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil

LAUNCH_LOCK = Path(tempfile.gettempdir()) / "packed-transformers-tests-launch.lock"
STACKS_WAIT_S = 5.0  # what the group gets after SIGABRT to write its stacks
# stderr kept in Hung's message: every process of a group writes its stacks (a launcher's and
# each rank's, ~5,000 characters each with the extension list), and a rank's are the ones wanted
HUNG_STDERR_CHARS = 40_000


RUN_TAG = "PACKED_TESTS_RUN_TAG"


def tagged(tag: str) -> list[psutil.Process]:
    """The live processes whose environment holds RUN_TAG=tag (a command's, and whatever it
    started, whichever session or group they are in)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and process.environ().get(RUN_TAG) == tag:
                found.append(process)
    return found


def signal_all(pgid: int, tag: str, number: int) -> None:
    """`number` to the command's group and to every process holding its tag."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, number)
    for process in tagged(tag):
        with contextlib.suppress(psutil.Error):
            process.send_signal(number)


class LeftBehind(AssertionError):
    """Processes of a command's group were still running after it ended."""


class Hung(AssertionError):
    """A command ran past its timeout; the message holds the end of its stderr (the stacks)."""


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launches_processes(command) -> bool:
    """Whether the command starts ranks of its own (torchrun)."""
    return "torch.distributed.run" in command or "torchrun" in command


@contextlib.contextmanager
def one_launch_at_a_time(exclusive: bool):
    """Hold the machine-wide launch lock (flock: released if the holder dies) when exclusive."""
    if not exclusive:
        yield
        return
    with open(LAUNCH_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_in_group(command, timeout: float, **options) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) in a group of its own; on a
    timeout the whole group is sent SIGABRT (stacks to stderr), then killed, and Hung raised
    with the stderr's end (subprocess.run kills only the launcher); a group with processes
    left once the launcher has exited is killed and LeftBehind raised. The output goes through
    files, not pipes: a process left behind would hold a pipe open, and the wait would last
    as long as it does. The timeout counts from the start, after the launch lock."""
    tag = uuid.uuid4().hex
    env = dict(options.pop("env", None) or os.environ, PYTHONFAULTHANDLER="1", **{RUN_TAG: tag})
    with one_launch_at_a_time(launches_processes(command)):
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process = subprocess.Popen(
                command, stdout=out, stderr=err, text=True, start_new_session=True, env=env, **options
            )
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_and_raise(process, tag, command, timeout, err)
            stdout, stderr = read(out), read(err)
        left = tagged(tag)
        if group_alive(process.pid) or left:
            signal_all(process.pid, tag, signal.SIGKILL)
            raise LeftBehind(
                f"{command[:4]}...: processes it started outlived it (killed: {[p.pid for p in left]}): "
                f"{stderr[-2000:]}"
            )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_together(commands: list, timeout: float, **options) -> list[subprocess.CompletedProcess]:
    """run_in_group for commands that must run at once (the nodes of one torchrun job: each
    waits in the rendezvous for the others), under one launch lock: each in a group of its
    own, all waited for; a timeout stops every group (stacks to stderr) and raises Hung."""
    tag = uuid.uuid4().hex
    env = dict(options.pop("env", None) or os.environ, PYTHONFAULTHANDLER="1", **{RUN_TAG: tag})
    with one_launch_at_a_time(True), contextlib.ExitStack() as files:
        started = []
        for command in commands:
            out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            process = subprocess.Popen(
                command, stdout=out, stderr=err, text=True, start_new_session=True, env=env, **options
            )
            started.append((command, process, out, err))
        deadline = time.monotonic() + timeout
        for command, process, _, err in started:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for _, other, _, _ in started:
                    if other is not process:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(other.pid, signal.SIGKILL)
                stop_and_raise(process, tag, command, timeout, err)
        done = [subprocess.CompletedProcess(c, p.returncode, read(o), read(e)) for c, p, o, e in started]
    left = tagged(tag)
    for command, process, _, _ in started:
        if group_alive(process.pid) or left:
            signal_all(process.pid, tag, signal.SIGKILL)
            raise LeftBehind(f"{command[:4]}...: processes it started outlived it (killed)")
    return done


def stop_and_raise(process: subprocess.Popen, tag: str, command, timeout: float, err) -> None:
    signal_all(process.pid, tag, signal.SIGABRT)  # the group and its tagged ranks write their stacks
    deadline = time.monotonic() + STACKS_WAIT_S
    while (group_alive(process.pid) or tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_all(process.pid, tag, signal.SIGKILL)
    process.wait()
    raise Hung(
        f"{command[:6]}... ran past {timeout} s; the end of its stderr:\n{read(err)[-HUNG_STDERR_CHARS:]}"
    )


def read(file) -> str:
    file.seek(0)
    return file.read()
