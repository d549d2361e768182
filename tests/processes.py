"""Subprocesses that never outlive their test: each command runs in a process group of its
own (a new session), and whatever of that group is still alive when the command ends or
times out (a torchrun rank left waiting in gloo's rendezvous after its launcher died: one
was found running 50 minutes after the suite) is killed and reported as a failure."""

from __future__ import annotations

import os
import signal
import subprocess


class LeftBehind(AssertionError):
    """Processes of a command's group were still running after it ended."""


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_in_group(command, timeout: float, **options) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) in a group of its own; on a
    timeout the whole group is killed (subprocess.run kills only the launcher); a group
    with processes left once the launcher has exited is killed and LeftBehind raised. The
    output goes through files, not pipes: a process left behind would hold a pipe open, and
    the wait would last as long as it does."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            command, stdout=out, stderr=err, text=True, start_new_session=True, **options
        )
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise subprocess.TimeoutExpired(command, timeout, read(out), read(err)) from None
        stdout, stderr = read(out), read(err)
    if group_alive(process.pid):
        os.killpg(process.pid, signal.SIGKILL)
        raise LeftBehind(f"{command[:4]}...: processes of its group outlived it (killed): {stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def read(file) -> str:
    file.seek(0)
    return file.read()
