"""The warm launcher's client: commands the tests start as `python -m packed_transformers...`,
`python -m torch.distributed.run ...`, `python -m tests.ipu_instance ...` (a poprun instance on
the PopTorch double) or `python <a script of this repository>` are forked
from a process that has torch and transformers imported (tests/warm_zygote.py says how, and
what the command gets as a fresh interpreter would), instead of each paying 4-5 CPU-seconds of
imports.

It works under subprocess.Popen, so every caller (subprocess.run, tests/processes.py's groups,
a test's own Popen) is served unchanged: `install()` wraps Popen._execute_child, and a command
this module takes (`warm_plan`) is sent to the server; the Popen object gets the command's real
pid (signals, process groups and sessions work on it as on any process), the pipes it asked
for, and wait/poll read the exit status the server reports (the command is the server's child,
not the test's). Everything else starts cold, as before:
- other programs and interpreters, `python -c ...`, any option but -u (`-X importtime` asks
  what a fresh interpreter imports);
- an environment that differs from the server's in a variable read when torch or transformers
  is imported (PYTHON*, HF_*, TRANSFORMERS_*, TORCH*, MKL_*, ONEDNN_*, ...: the server imported
  them under its own), but for the ones the server applies per command (OMP_NUM_THREADS,
  PYTHONFAULTHANDLER, PYTHONUNBUFFERED, PYTHONWARNINGS);
- a preexec_fn, user or group changes, close_fds=False, a launch from a thread other than
  the main one;
- Ray's workers.
A torchrun the server forked forks its ranks itself (`install_local_forks`); a bench script
(bench/*.py, which computes, so it cannot fork) gets a socket to the server of its own, and
the commands it times start warm as the test process's do (`join`).
PACKED_TESTS_COLD=1 starts everything cold (in a command's own environment: that command).
`counts` says how many of each this process started; tests/conftest.py prints the sum at the
end of a run."""

from __future__ import annotations

import collections
import functools
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ZYGOTE_SCRIPT = Path(__file__).with_name("warm_zygote.py")
WARM_MODULES = ("packed_transformers", "torch.distributed.run", "tests.ipu_instance")
READ_AT_IMPORT = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "GOMP_",
                  "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "CUDA", "LD_", "XDG_CACHE_HOME", "SAFETENSORS")  # fmt: skip
APPLIED_PER_COMMAND = {
    "OMP_NUM_THREADS",
    "PYTHONFAULTHANDLER",
    "PYTHONUNBUFFERED",
    "PYTHONWARNINGS",
    "PYTHONPATH",
}
# Read when used, not at import: inductor's cache folder (torch's cache_dir() writes its
# default back into the test process's environment), what torchrun gives its ranks, and
# breakpoint()'s hook (read at each call).
READ_WHEN_USED = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHELASTIC_",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTHONBREAKPOINT",
)
READY_TIMEOUT_S = 300.0  # the server's imports, on a loaded 2-core machine

counts: collections.Counter = collections.Counter()  # "warm", and "cold: <why>" for Python commands
_original_execute_child = subprocess.Popen._execute_child
_server: Server | None = None


class Server:
    """The zygote process and the control socket to it."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, str(ZYGOTE_SCRIPT), str(theirs.fileno())], pass_fds=[theirs.fileno()], cwd=REPO,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.control = ours
        self.env = dict(os.environ)  # what its imports read
        self.lock = threading.Lock()
        self.state = "starting"  # then "ready", or "broken" (every command cold from then on)

    def usable(self) -> bool:
        if self.state == "starting":
            self.control.settimeout(READY_TIMEOUT_S)
            try:
                self.state = "ready" if self.control.recv(16) == b"ready" else "broken"
            except OSError:
                self.state = "broken"
            self.control.settimeout(None)
            if self.state == "broken":
                print("warm launcher: the server did not start; commands start cold", file=sys.stderr)
        return self.state == "ready"

    def launch(self, request: dict, fds: list[int]) -> tuple[int | str, socket.socket | None]:
        """Fork the command; returns its pid and the socket its exit status will arrive on, or
        why the server would not (it starts cold then) and None."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self.lock:
                socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno(), *fds])
        finally:
            theirs.close()
        reply = ours.recv(512).decode()
        if reply.startswith("cold "):
            ours.close()
            return reply.removeprefix("cold "), None
        if not reply.startswith("pid "):
            ours.close()
            raise OSError(f"warm launcher: the server answered {reply!r} instead of a pid")
        return int(reply.split()[1]), ours

    def stop(self) -> None:
        self.control.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def warm_plan(
    base_env: dict, args, executable, preexec_fn, close_fds, env, shell, gid, gids, uid, umask
) -> tuple[list, bool] | str:
    """(argv after the interpreter, unbuffered) when the command can start warm, else why not."""
    if shell or executable is not None or isinstance(args, (str, bytes, os.PathLike)):
        return "not a list"
    args = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in args]
    if not args or args[0] != sys.executable:
        return ""  # not a Python command of this interpreter: not counted
    if (
        preexec_fn is not None
        or not close_fds
        or gid is not None
        or gids is not None
        or uid is not None
        or umask >= 0
    ):
        return "process options"
    if threading.current_thread() is not threading.main_thread():
        return "launched from a thread"
    rest, unbuffered = args[1:], False
    if rest[:1] == ["-u"]:
        rest, unbuffered = rest[1:], True
    if not rest or not all(isinstance(a, str) for a in rest):
        return "arguments"
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1].startswith(WARM_MODULES):
            return f"-m {rest[1] if len(rest) > 1 else ''}".strip()
    elif rest[0].startswith("-"):
        return rest[0]
    else:
        script = Path(rest[0]).resolve()
        if (
            script.suffix != ".py"
            or REPO not in script.parents
            or ".venv" in script.parts
            or script == ZYGOTE_SCRIPT
        ):
            return "a script outside the repository"
    environment = dict(os.environ if env is None else env)
    if environment.get("PACKED_TESTS_COLD"):
        return "asked for"
    changed = {k for k in set(environment) | set(base_env) if environment.get(k) != base_env.get(k)}
    read_at_import = sorted(
        k
        for k in changed - APPLIED_PER_COMMAND
        if str(k).upper().startswith(READ_AT_IMPORT) and not str(k).startswith(READ_WHEN_USED)
    )
    if read_at_import:
        return f"environment {read_at_import[0]}"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in environment.items()):
        return "environment"
    return rest, unbuffered


def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                   shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids,
                   uid, umask, start_new_session, process_group):  # fmt: skip
    plan = ""  # not counted: the launcher is off
    if _server is not None:
        plan = warm_plan(
            _server.env, args, executable, preexec_fn, close_fds, env, shell, gid, gids, uid, umask
        )
    if isinstance(plan, tuple) and not _server.usable():
        plan = "server broken"
    if isinstance(plan, tuple):
        sys.audit("subprocess.Popen", sys.executable, list(args), cwd, env)
        request, fds = command_request(plan, cwd, env, pass_fds, p2cread, c2pwrite, errwrite, start_new_session,
                                       process_group)  # fmt: skip
        pid, status = _server.launch(request, fds)
        if status is not None:
            self.pid = pid
            self._child_created = True
            self._warm_status = status
            self._warm_waitstatus = None
            self._internal_poll = functools.partial(_poll, self)
            self._try_wait = functools.partial(_try_wait, self)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
            counts["warm"] += 1
            return
        plan = pid  # the server's reason to decline
    if plan:
        counts[f"cold: {plan}"] += 1
    return _original_execute_child(
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
        start_new_session, process_group,
    )  # fmt: skip


def ignored_signals() -> list[int]:
    """The signals this process ignores (SIG_IGN): exec keeps them ignored in a child."""
    import signal

    found = []
    for number in range(1, signal.NSIG):
        try:
            if signal.getsignal(number) is signal.SIG_IGN:
                found.append(number)
        except (OSError, ValueError):
            continue
    return found


def command_request(plan, cwd, env, pass_fds, p2cread, c2pwrite, errwrite, start_new_session, process_group):
    """What the server (or a local fork) needs to become the command, and the descriptors
    [stdin, stdout, stderr, *pass_fds] it gets (this process's own 0, 1, 2 where not redirected)."""
    argv, unbuffered = plan
    request = {
        "argv": argv, "unbuffered": unbuffered, "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
        "env": dict(os.environ if env is None else env), "new_session": bool(start_new_session),
        "process_group": process_group, "pass_fds": [int(fd) for fd in pass_fds],
        # what a cold child inherits through exec: the signals this process ignores (a run started
        # in the background by a shell without job control ignores SIGINT and SIGQUIT)
        "ignored_signals": ignored_signals(),
    }  # fmt: skip
    std = [
        p2cread if p2cread != -1 else 0,
        c2pwrite if c2pwrite != -1 else 1,
        errwrite if errwrite != -1 else 2,
    ]
    return request, [*std, *request["pass_fds"]]


def install_local_forks(become, search_path_conflict) -> None:
    """In a launcher the server has forked (torchrun, which computes nothing itself): its
    ranks, `python -u script` or `python -u -m module`, are forked from it directly and become
    their command through `become` (tests/warm_zygote.py's). They are its real children, so
    waiting needs nothing of ours. The launcher's own environment is the base: torchrun's
    additions are read when used (READ_WHEN_USED)."""
    base_env = dict(os.environ)

    def execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                      creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                      restore_signals, gid, gids, uid, umask, start_new_session, process_group):  # fmt: skip
        plan = warm_plan(base_env, args, executable, preexec_fn, close_fds, env, shell, gid, gids, uid, umask)
        if isinstance(plan, tuple) and search_path_conflict(dict(os.environ if env is None else env)):
            plan = "PYTHONPATH"
        if not isinstance(plan, tuple):
            return _original_execute_child(
                self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                umask, start_new_session, process_group,
            )  # fmt: skip
        sys.audit("subprocess.Popen", sys.executable, list(args), cwd, env)
        request, fds = command_request(plan, cwd, env, pass_fds, p2cread, c2pwrite, errwrite, start_new_session,
                                       process_group)  # fmt: skip
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = become(request, fds)
            except BaseException:
                import traceback

                traceback.print_exc()
            os._exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    subprocess.Popen._execute_child = execute_child


def _read_status(self, block: bool) -> int | None:
    """The command's wait status once the server has reported it; None while it runs."""
    if self._warm_waitstatus is None:
        try:
            message = self._warm_status.recv(64) if block else self._warm_status.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if not message.startswith(b"status "):  # the server is gone: the status is lost
            print(f"warm launcher: no exit status for pid {self.pid} (server gone)", file=sys.stderr)
            self._warm_waitstatus = 255 << 8
        else:
            self._warm_waitstatus = int(message.split()[1])
        self._warm_status.close()
    return self._warm_waitstatus


def _try_wait(self, wait_flags):
    """Popen._try_wait's contract (callers hold _waitpid_lock): (pid, status), (0, 0) if running."""
    status = _read_status(self, block=not wait_flags & os.WNOHANG)
    return (0, 0) if status is None else (self.pid, status)


def _poll(self, _deadstate=None, **_):
    """Popen._internal_poll's contract, reading the server's report instead of waitpid."""
    if self.returncode is None:
        if not self._waitpid_lock.acquire(False):
            return None
        try:
            if self.returncode is None:
                status = _read_status(self, block=False)
                if status is not None:
                    self._handle_exitstatus(status)
        finally:
            self._waitpid_lock.release()
    return self.returncode


def install() -> None:
    """Start the server (its imports overlap the collection of tests) and route Popen through it."""
    global _server
    if os.environ.get("PACKED_TESTS_COLD") or not hasattr(os, "pidfd_open") or _server is not None:
        return
    _server = Server()
    subprocess.Popen._execute_child = _execute_child


def join(control: socket.socket, server_env: dict) -> None:
    """In a bench script the server has forked: route its Popen through the server over
    `control` (its own socket to it), judged against the server's environment, as the test
    process's commands are: the commands a bench times start warm too."""
    global _server
    server = Server.__new__(Server)
    server.process, server.control, server.env = None, control, server_env
    server.lock, server.state = threading.Lock(), "ready"
    _server = server
    subprocess.Popen._execute_child = _execute_child


def server_pid() -> int | None:
    return _server.process.pid if _server is not None else None


def uninstall() -> None:
    global _server
    subprocess.Popen._execute_child = _original_execute_child
    if _server is not None:
        _server.stop()
        _server = None
