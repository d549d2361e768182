"""A command for tests/house/test_warm_launch.py: prints what it sees of its process as one JSON line
(before importing anything of ours), then ends as its first argument asks: `exit N`,
`raise` (an uncaught exception), `sleep` (until a signal), `interrupt` (an uncaught
KeyboardInterrupt), `spawn N [cold]` (runs itself with `exit N`, cold if asked, and prints that one's
line and `returned N`)."""

import json
import os
import signal
import sys
import time

preloaded = sorted(m for m in ("torch", "transformers", "packed_transformers") if m in sys.modules)
state = {
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "path": sys.path, "preloaded": preloaded,
    "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "env": os.environ.get("PROBE_VALUE"),
    "stdin": sys.stdin.read() if "stdin" in sys.argv else None, "main": __name__,
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2 and os.path.exists(f"/proc/self/fd/{fd}")),
    "sigint": str(signal.getsignal(signal.SIGINT)), "sigterm": str(signal.getsignal(signal.SIGTERM)),
    "sigpipe": str(signal.getsignal(signal.SIGPIPE)), "stdout_tty": sys.stdout.isatty(),
}  # fmt: skip
print(json.dumps(state), flush=True)
print("to stderr", file=sys.stderr)
action = sys.argv[1]
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "raise":
    raise ValueError("the probe raised")
if action == "sleep":
    time.sleep(60)
if action == "interrupt":
    raise KeyboardInterrupt
if action == "spawn":
    import subprocess

    env = dict(os.environ, PACKED_TESTS_COLD="1") if sys.argv[3:] == ["cold"] else None
    child = subprocess.run(
        [sys.executable, __file__, "exit", sys.argv[2]], capture_output=True, text=True, env=env
    )
    print(child.stdout.split("\n", 1)[0], flush=True)
    print(f"returned {child.returncode}", flush=True)
