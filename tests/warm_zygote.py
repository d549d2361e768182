"""The warm launcher's server (a "zygote", as Android's and Chromium's are called): a process
that imports torch, transformers and the third-party modules the package's commands import,
runs nothing, and forks each command the tests start as `python -m ...` or `python script.py`
from that state, so the command's child skips the 4-5 CPU-seconds of imports each fresh
interpreter pays (tests/warm_launch.py decides which commands, and is the client).

Started by tests/warm_launch.py as `python tests/warm_zygote.py FD`, FD one end of a
SOCK_SEQPACKET socket pair. Protocol, one message per request, with file descriptors attached
(SCM_RIGHTS): JSON {"argv", "cwd", "env", "unbuffered", "new_session", "process_group",
"pass_fds"} and
the descriptors [status, stdin, stdout, stderr, *pass_fds]. On `status` (a socket of its own
per command) the server answers `pid N` once forked and `status S` (os.waitpid's status)
when the command has ended; its client reads them as waitpid's results. A bench script
(`is_bench`) is forked holding one end of a socket pair whose other end this server reads as
it reads the client's: the commands the bench times are forked from here too.

Why a separate, fresh process and not a fork of the test process itself: GNU OpenMP's thread
pool does not survive fork (a child of a process that has run a parallel region hangs at its
first one with more than one thread: measured with torch 2.13), and the test process carries
pytest's state (capture, logging handlers, warning filters, monkeypatches, sys.path). This
process never computes, and its own modules (the package included) are dropped before each
command runs, so a command re-imports the package as a fresh interpreter would.

What a forked command gets as a fresh interpreter would (done in `become`): its own session or
process group when asked, the descriptors at 0, 1, 2 and pass_fds and no others, cwd,
environment, sys.argv, sys.path[0], __main__, standard streams (line-buffered where a terminal,
unbuffered with -u or PYTHONUNBUFFERED), signal dispositions, faulthandler per
PYTHONFAULTHANDLER, the interpreter's default warning filters, torch's thread count from
OMP_NUM_THREADS, and the exit: SystemExit's code, 1 and a traceback for an exception, death
by SIGINT for an uncaught KeyboardInterrupt, non-daemon threads joined, atexit run. What it
does not get: a parent pid of the test process (its parent is this server) and a fresh
hash seed (tests/warm_launch.py starts commands cold whose environment sets PYTHONHASHSEED)."""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import io
import json
import os
import pkgutil
import select
import signal
import socket
import sys
import threading
import traceback
import types
import warnings

warm_launch = None  # tests/warm_launch.py, imported by main() (this file runs as a script)
# PYTHONPATH's entries in this process's sys.path (after sys.path[0]): the server's own, set
# by main(), and a command's once it has become one (a torchrun's ranks are forked from it)
search_path_entries: list[str] = []
server_environment: dict = {}  # this process's environment at its start: what its imports read
MAX_MESSAGE = 1 << 20
MAX_FDS = 64
# Modules the package imports that must not be preloaded: Ray starts processes and threads at
# import; TensorFlow is slow to import and only one test's child needs it.
NOT_PRELOADED = ("packed_transformers.ray_jobs",)
PRODUCT = ("packed_transformers", "run_pretraining")
DEFAULT_WARNING_FILTERS = [  # a fresh CPython 3.11 without -W or PYTHONWARNINGS (warnings.filters at start)
    ("default", None, DeprecationWarning, "__main__", 0),
    ("ignore", None, DeprecationWarning, None, 0),
    ("ignore", None, PendingDeprecationWarning, None, 0),
    ("ignore", None, ImportWarning, None, 0),
    ("ignore", None, ResourceWarning, None, 0),
]


def preload() -> None:
    """Import every module of the package (but Ray's room), for the third-party modules they
    import, then forget the package's own modules: each command imports those afresh."""
    import packed_transformers

    for info in pkgutil.walk_packages(packed_transformers.__path__, "packed_transformers."):
        if info.name.startswith(NOT_PRELOADED) or info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional extra missing (poptorch): the command finds out itself
            continue
    forget_product_modules()


def forget_product_modules() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in PRODUCT]:
        del sys.modules[name]


def serve(control: socket.socket) -> None:
    """Fork a command per request; report each one's pid and end on its status socket. Ends
    when the client's end of `control` closes (its test process ended). A bench script's own
    control socket (`start`) is served alike while the script runs."""
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, status socket)
    benches: set[socket.socket] = set()  # the control sockets of running bench scripts
    while True:
        readable, _, _ = select.select([control, *benches, *running], [], [])
        for ready in readable:
            if ready is control or ready in benches:
                message, fds, _, _ = socket.recv_fds(ready, MAX_MESSAGE, MAX_FDS)
                if not message:
                    if ready is control:
                        return
                    benches.discard(ready)  # the bench script ended
                    ready.close()
                    continue
                started = start(json.loads(message), fds)
                if started is not None:
                    running[started[0]] = started[1][:2]
                    if started[1][2] is not None:
                        benches.add(started[1][2])
            else:
                pid, status_socket = running.pop(ready)
                _, status = os.waitpid(pid, 0)
                os.close(ready)
                try:
                    status_socket.send(f"status {status}".encode())
                except OSError:  # the client is gone
                    pass
                status_socket.close()


def start(request: dict, fds: list[int]):
    status_socket = socket.socket(fileno=fds[0])
    why_cold = search_path_conflict(request["env"])
    if why_cold:  # the client starts it as a fresh interpreter
        for fd in fds:
            os.close(fd)
        status_socket.send(f"cold {why_cold}".encode())
        status_socket.close()
        return None
    # A bench script starts commands of its own (the ways it times, each a whole process): it
    # gets a control socket to this server, so they start warm too (a forked bench script has
    # computed: it cannot fork them itself, GNU OpenMP's pool does not survive a fork).
    bench_control, theirs = (
        socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if is_bench(request) else (None, None)
    )
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if bench_control is not None:
                bench_control.close()
            code = become(request, fds[1:], theirs)
        except BaseException:  # the set-up failed: say so where the command's stderr goes
            traceback.print_exc()
        os._exit(code)
    for fd in fds[1:]:
        os.close(fd)
    if theirs is not None:
        theirs.close()
    status_socket.send(f"pid {pid}".encode())
    return os.pidfd_open(pid), (pid, status_socket, bench_control)


def is_bench(request: dict) -> bool:
    """A script of the repository's bench/ folder (not `-m`), or any script whose environment
    sets PACKED_TESTS_NESTED (tests/house/test_warm_launch.py's probe)."""
    first = request["argv"][0]
    if first.startswith("-"):
        return False
    if request["env"].get("PACKED_TESTS_NESTED"):
        return True
    script = os.path.abspath(os.path.join(request["cwd"], first))
    return os.path.dirname(script) == os.path.join(str(warm_launch.REPO), "bench")


def become(request: dict, fds: list[int], bench_control: socket.socket | None = None) -> int:
    """Turn this forked child into the command of `request` and run it; returns only the exit
    code for os._exit (an uncaught KeyboardInterrupt kills it with SIGINT instead). A bench
    script's `bench_control` (its end of a socket to the server) routes its own Python
    commands through the server (tests/warm_launch.py `join`)."""
    if request["new_session"]:
        os.setsid()
    elif request["process_group"] >= 0:
        os.setpgid(0, request["process_group"])
    kept = None
    if bench_control is not None:  # out of every descriptor's way, closed at an exec
        import fcntl

        kept = fcntl.fcntl(
            bench_control.fileno(), fcntl.F_DUPFD_CLOEXEC, max([2, *fds, *request["pass_fds"]]) + 1
        )
        bench_control.close()
    place_descriptors(fds, request["pass_fds"], kept)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    reset_interpreter(request)
    if request["argv"][:2] == ["-m", "torch.distributed.run"]:
        warm_launch.install_local_forks(become, search_path_conflict)  # its ranks forked from it, warm too
    if kept is not None:
        warm_launch.join(socket.socket(fileno=kept), server_environment)
    return run_command(request["argv"])


def pythonpath_entries(env: dict) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def search_path_conflict(env: dict) -> str | None:
    """Why a command with this environment's PYTHONPATH cannot start from this process: an
    entry holding a module this process has already imported from elsewhere (a test double
    of an imported package would not be seen). None when it can."""
    for entry in pythonpath_entries(env):
        if entry in search_path_entries or not os.path.isdir(entry):
            continue
        for name in os.listdir(entry):
            top = name.removesuffix(".py")
            module = sys.modules.get(top)
            if module is None or top in PRODUCT:
                continue
            where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), "")
            if not os.path.abspath(where).startswith(os.path.abspath(os.path.join(entry, name))):
                return f"PYTHONPATH {entry} holds {top}, imported here from elsewhere"
    return None


def set_search_path(path0: str, env: dict) -> None:
    """sys.path as a fresh interpreter builds it: the script's folder (or cwd for -m), the
    environment's PYTHONPATH, then the interpreter's own (this process's, less its PYTHONPATH)."""
    global search_path_entries
    own = sys.path[1:]
    for entry in search_path_entries:
        if entry in own:
            own.remove(entry)
    search_path_entries = pythonpath_entries(env)
    sys.path[:] = [path0, *search_path_entries, *own]


def place_descriptors(fds: list[int], pass_fds: list[int], kept: int | None = None) -> None:
    """fds = [stdin, stdout, stderr, *pass_fds' descriptors as received]: put each at its
    number (0, 1, 2, then pass_fds' own numbers) and close every other descriptor but `kept`
    (above them all)."""
    import fcntl

    targets = [0, 1, 2, *pass_fds]
    high = max([*targets, *fds]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high) for fd in fds]  # out of every target's way
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)  # inheritable, as a command's descriptors are after exec
    keep = sorted(set(targets) | ({kept} if kept is not None else set()))
    start = 3
    for fd in keep:
        if fd >= start:
            os.closerange(start, fd)
            start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX"))


def reset_interpreter(request: dict) -> None:
    env = request["env"]
    ignored = set(request.get("ignored_signals", ()))  # what exec would have kept ignored
    for number in range(1, signal.NSIG):
        try:
            signal.signal(number, signal.SIG_IGN if number in ignored else signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP and the real-time range
            continue
    if signal.SIGINT not in ignored:  # CPython's start-up leaves an inherited SIG_IGN alone
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as CPython's start-up sets them
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    unbuffered = request["unbuffered"] or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _stream(0, "r", unbuffered)
    sys.stdout = sys.__stdout__ = _stream(1, "w", unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, "w", unbuffered, errors="backslashreplace")
    faulthandler.disable()
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    warnings.filters[:] = list(DEFAULT_WARNING_FILTERS)
    warnings._filters_mutated()
    if env.get("PYTHONWARNINGS"):
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _stream(fd: int, mode: str, unbuffered: bool, errors: str = "strict") -> io.TextIOWrapper:
    """A standard stream as CPython 3.11 opens it at start-up."""
    raw = io.FileIO(fd, mode + "b" if mode == "w" else "rb", closefd=False)
    terminal = raw.isatty()
    if unbuffered and mode == "w":
        buffered = raw
    else:
        buffered = (io.BufferedWriter if mode == "w" else io.BufferedReader)(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=terminal or fd == 2,
                            write_through=unbuffered and mode == "w")  # fmt: skip


def run_command(argv: list[str]) -> int:
    """argv as after `python [-u]`: ["-m", module, *args] or [script, *args]."""
    import runpy

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    interrupted = False
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            set_search_path(os.getcwd(), os.environ)
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            set_search_path(os.path.dirname(os.path.abspath(script)), os.environ)
            main.__file__ = script
            main.__cached__ = None
            with open(script, "rb") as source:
                code = compile(source.read(), script, "exec")
            exec(code, main.__dict__)
        code = 0
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException as error:
        error = error.with_traceback(
            error.__traceback__.tb_next
        )  # from the command's frames on, as a fresh one
        sys.excepthook(type(error), error, error.__traceback__)
        interrupted = isinstance(error, KeyboardInterrupt)
        code = 1
    threading._shutdown()  # as Py_FinalizeEx: non-daemon threads first, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    global warm_launch, search_path_entries, server_environment
    search_path_entries = pythonpath_entries(os.environ)
    server_environment = dict(os.environ)
    control = socket.socket(fileno=int(sys.argv[1]))
    sys.path[0] = os.getcwd()  # the repository (the client starts this process there), for the package
    from tests import warm_launch

    preload()
    try:
        control.send(b"ready")
        serve(control)
    except (ConnectionResetError, BrokenPipeError):  # the test process ended first
        return


if __name__ == "__main__":
    main()
