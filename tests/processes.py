"""Subprocesses that never outlive their test: each command runs in a process group of its
own (a new session), and whatever of that group is still alive when the command ends or
times out (a torchrun rank left waiting in gloo's rendezvous after its launcher died: one
was found running 50 minutes after the suite) is killed and reported as a failure.

Launches of several processes (torchrun) take one machine-wide lock, so that two of them
never share the two cores of a CI machine: a Trainer run over 2 ranks hung past its timeout
once while another test's 4 ranks ran beside it (CI, 2026-11-28). A command that times out
is sent SIGABRT first: with PYTHONFAULTHANDLER set, every Python process of the group writes
the stack of each of its threads to stderr, and the failure shows where it waited."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

LAUNCH_LOCK = Path(tempfile.gettempdir()) / "packed-transformers-tests-launch.lock"
STACKS_WAIT_S = 5.0  # what the group gets after SIGABRT to write its stacks
# stderr kept in Hung's message: every process of a group writes its stacks (a launcher's and
# each rank's, ~5,000 characters each with the extension list), and a rank's are the ones wanted
HUNG_STDERR_CHARS = 40_000


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
    env = dict(options.pop("env", None) or os.environ, PYTHONFAULTHANDLER="1")
    with one_launch_at_a_time(launches_processes(command)):
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process = subprocess.Popen(
                command, stdout=out, stderr=err, text=True, start_new_session=True, env=env, **options
            )
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_and_raise(process, command, timeout, err)
            stdout, stderr = read(out), read(err)
        if group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
            raise LeftBehind(
                f"{command[:4]}...: processes of its group outlived it (killed): {stderr[-2000:]}"
            )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_together(commands: list, timeout: float, **options) -> list[subprocess.CompletedProcess]:
    """run_in_group for commands that must run at once (the nodes of one torchrun job: each
    waits in the rendezvous for the others), under one launch lock: each in a group of its
    own, all waited for; a timeout stops every group (stacks to stderr) and raises Hung."""
    env = dict(options.pop("env", None) or os.environ, PYTHONFAULTHANDLER="1")
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
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(other.pid, signal.SIGKILL)
                stop_and_raise(process, command, timeout, err)
        done = [subprocess.CompletedProcess(c, p.returncode, read(o), read(e)) for c, p, o, e in started]
    for command, process, _, _ in started:
        if group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
            raise LeftBehind(f"{command[:4]}...: processes of its group outlived it (killed)")
    return done


def stop_and_raise(process: subprocess.Popen, command, timeout: float, err) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGABRT)
    deadline = time.monotonic() + STACKS_WAIT_S
    while group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    raise Hung(
        f"{command[:6]}... ran past {timeout} s; the end of its stderr:\n{read(err)[-HUNG_STDERR_CHARS:]}"
    )


def read(file) -> str:
    file.seek(0)
    return file.read()
