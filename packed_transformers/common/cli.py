"""What every command line of the project shares."""

from __future__ import annotations

import argparse
import copy
import difflib
import os
import signal
import sys
from pathlib import Path


def own_process_handler(handle):
    """`handle(signum, frame)` as a signal handler of this process alone. A child process a
    library forks later (OpenVINO's telemetry senders, a tokenizer's or a data loader's
    workers) inherits Python's handlers; one that receives the signal there ends by the
    signal's default action, instead of running the parent's handler (which raised
    KeyboardInterrupt into it and printed its traceback)."""
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        handle(signum, frame)

    return handler


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a
    one-line `error:` quotes of a library's multi-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows every option's default, documented or not, unless its help already
    names one; flags (default False) and options without a default show none."""

    def _format_action(self, action):
        shown = (
            action.option_strings
            and action.default is not None
            and action.default is not False
            and action.default is not argparse.SUPPRESS
            and "default" not in (action.help or "")
        )
        if shown:
            action = copy.copy(action)
            action.help = ((action.help or "") + " (default: %(default)s)").strip()
        return super()._format_action(action)


def option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string a parser takes, its subcommands' included."""
    names = []
    for action in parser._actions:
        names += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names += option_names(sub)
    return names


class CommandParser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are one `error:` line (exit 2), a mistyped option
    with the nearest real one ("did you mean --output?"), rather than the usage block."""

    def parse_args(self, args=None, namespace=None):
        """A mistyped option is named first: argparse would report the required option it
        hides (`--ouput` -> "--output is required") before the unknown one."""
        argv = sys.argv[1:] if args is None else [str(a) for a in args]
        known = option_names(self)
        for word in argv:
            name = word.split("=")[0]
            if word == "--":
                break
            if name.startswith("--") and not any(option.startswith(name) for option in known):
                self.error(f"unrecognized arguments: {word}")
        return super().parse_args(argv, namespace)

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):  # (str.removeprefix is Python 3.9+; this module runs on 3.8)
            unknown = message[len(prefix) :]
            known = option_names(self)
            hints = []
            for word in unknown.split():
                close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.6)
                hints.append(f"{word} (did you mean {close[0]}?)" if close else word)
            message = "unrecognized arguments: " + ", ".join(hints)
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


# The program name the `packed` launcher ran a job under (commands/packed.py sets it before it
# runs the job's module): `packed embed`, or `packed` where the job's parser has subcommands of
# its own (`packed pack`: argparse adds the subcommand's name). None: run as `python -m ...`.
LAUNCHED_AS: str | None = None


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a command: its name (`prog`, or the `packed` launcher's name for it), the
    first paragraph of the module's docstring as description, every option's default in
    --help, mistakes in one line (CommandParser)."""
    return CommandParser(
        prog=LAUNCHED_AS or prog, description=doc.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )


PACKING_ALGORITHMS = ("spfhp", "lpfhp", "nnlshp", "lp")


def add_inference_options(parser: argparse.ArgumentParser, model_help: str) -> None:
    """What every inference command (predict, embed, serve) takes alike: the model folder,
    the device and dtype, and how examples are packed."""
    parser.add_argument("--model", required=True, type=Path, help=model_help)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "int8"),
        help="bfloat16: the forward under bf16 autocast (refused where the device has no bf16); int8: the "
        "transformer layers' matrix products in int8 (CPU with VNNI only; docs/embeddings.md has its quality)",
    )
    parser.add_argument(
        "--max-sequences-per-pack",
        type=int,
        default=None,
        help="K (default: chosen from the lengths for least padding; the server: per task)",
    )
    parser.add_argument("--algorithm", default="lpfhp", choices=PACKING_ALGORITHMS)
    add_verbose_option(parser)


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    """--verbose: the libraries' own load reports and progress bars (transformers'), which a
    command keeps off by default (model.hf_checkpoint.quiet_transformers): its own lines say it."""
    parser.add_argument(
        "--verbose", action="store_true", help="the libraries' own load reports and progress bars too"
    )


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """--ray and what goes with it (ray_jobs/job.py): the whole input on a Ray cluster,
    Parquet shards and a manifest in the --output folder."""
    ray = parser.add_argument_group("on a Ray cluster (pip install 'ray[data]==2.60.0'; docs/ray.md)")
    ray.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run on Ray: 'local' starts a cluster of this machine, 'auto' joins the one `ray start` made, or its "
        "address; --input may then be a file, a glob or a folder of JSON lines / Parquet, --output is a folder",
    )
    ray.add_argument("--workers", type=int, default=2, help="model replicas (Ray actors)")
    ray.add_argument("--threads-per-worker", type=int, default=1, help="CPUs (torch threads) per replica")
    ray.add_argument("--chunk-rows", type=int, default=4096, help="rows per shard (packed together)")
    ray.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output (--ray's folder; embed's .npy; predict's files)",
    )


def below_one(args: argparse.Namespace, names) -> str | None:
    """The error line for the first of `names` (argparse dests) set below 1, or None.
    Options left unset (None) pass."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    return None


CUDA_WHEEL = (
    "pip install --force-reinstall --no-deps torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
)


def no_gpu(what: str, torch_version: str, cuda_build: bool) -> str:
    """The one message every command gives when CUDA is asked for and torch sees no GPU:
    which torch it is, and the README's line for the CUDA build."""
    if not cuda_build:
        return (
            f"{what}: this torch ({torch_version}) is the CPU build that requirements.txt installs and sees no GPU; "
            f"on a machine with an NVIDIA GPU install the CUDA build (README): {CUDA_WHEEL}"
        )
    return f"{what}: torch {torch_version} (a CUDA build) sees no GPU on this machine (check nvidia-smi and CUDA_VISIBLE_DEVICES)"


def refuse(message: str) -> int:
    """The user's mistake as the one line every command answers with (`error: MESSAGE` on
    stderr). -> exit code 2."""
    import sys

    print(f"error: {message}", file=sys.stderr)
    return 2


def interruptible(work, *args):
    """work(*args), run in a thread while this (the main) thread waits for it in 0.1 s steps:
    Ctrl-C is then honoured within 0.1 s (KeyboardInterrupt raised here) even while the work
    sits inside a native library that returns to Python only at its end (the tokenizers
    library's training: 13 s late, measured). The thread is a daemon, abandoned on Ctrl-C:
    the process ends with it. work's own exception is raised here."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["value"] = work(*args)
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, name="interruptible", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


STOPPED_BY: list[int] = []  # the signal sigterm_as_interrupt's handler received


def sigterm_as_interrupt() -> None:
    """SIGTERM ends this command as Ctrl-C does: KeyboardInterrupt raised in the main thread,
    so every `finally` runs (an atomic folder's temporary is removed) and run_main prints its
    one line; run_main then exits 143. This process's handler only (own_process_handler)."""

    def stop(signum, frame):
        STOPPED_BY.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, own_process_handler(stop))


def run_main(main, on_interrupt: str) -> int:
    """main()'s exit code; Ctrl-C ends in one line saying what was kept (exit 130; 143 for a
    SIGTERM that sigterm_as_interrupt turned into one), never a traceback. Outputs are written
    by atomic rename, so an interrupted command leaves none."""
    import sys

    try:
        return main()
    except KeyboardInterrupt as err:  # a command that kept work raises it with what it kept
        print(f"interrupted: {err.args[0] if err.args else on_interrupt}", file=sys.stderr)
        return 128 + (STOPPED_BY[0] if STOPPED_BY else signal.SIGINT)
