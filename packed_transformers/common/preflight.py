"""The mistakes a command can answer before it imports torch and transformers (8-12 s on a
loaded 2-core machine): a path that is not there, a Hub id given as a folder, a file where
a folder is expected. Standard library only.

    # first lines of a command module, before its heavy imports:
    if __name__ == "__main__":
        from packed_transformers.common.preflight import exit_on_path_mistakes
        exit_on_path_mistakes({"--model": "folder", "--input": "file"})

Each mistake is one `error:` line and exit 2; anything not decided here (a malformed file,
a folder of the wrong kind) is left to the command, which says it after its imports.
"""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path

# owner/name as the Hugging Face Hub spells a model id
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def value_of(argv: list[str], option: str) -> str | None:
    """The value given to `option` (`--opt V` or `--opt=V`), the last if repeated."""
    found = None
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith(option + "="):
            found = word[len(option) + 1 :]
    return found


def path_mistake(option: str, value: str, kind: str) -> str | None:
    """The one line for `value` given to `option` when it cannot be what `kind` needs
    ("folder" | "file" | "config": a file or a shipped config's name | "inputs": a file, folder
    or glob), else None."""
    path = Path(value)
    if kind == "folder":
        if path.is_dir():
            return None
        if path.exists():
            return f"{option} {value}: not a folder (a model folder holds config.json and the weights)"
        if HUB_ID.match(value):
            name = value.split("/")[-1]
            return (
                f"{option} {value}: no such folder; this looks like a Hugging Face Hub id, and models are not "
                f"downloaded here: fetch it first (hf download {value} --local-dir models/{name}) "
                f"and give {option} models/{name}"
            )
        return f"{option} {value}: no such folder"
    if kind == "inputs":  # a file, a folder or a glob (the --ray commands)
        if any(c in value for c in "*?["):
            return None if glob.glob(value) else f"{option} {value}: the pattern matches no file"
        return None if path.exists() else f"{option} {value}: no such file or folder"
    if path.exists():
        return f"{option} {value}: is a directory; give a file" if path.is_dir() else None
    if kind == "config":  # a shipped config's name or README path (common.recipes) is read from the package
        from packed_transformers.common.recipes import shipped_config, shipped_config_names

        if shipped_config(path) is not None:
            return None
        return f"{option} {value}: file not found (the shipped configs, by name: {', '.join(shipped_config_names())})"
    return f"{option} {value}: file not found"


# what a folder `packed export` wrote needs (door.exported_folder): the light install
EXPORTED_NEEDS = ("onnxruntime", "tokenizers", "numpy")


def missing_packages(names=("torch", "transformers")) -> str | None:
    """One line if this Python lacks the project's packages (run outside .venv), else None.
    importlib's find_spec looks without importing."""
    from importlib.util import find_spec

    missing = [name for name in names if find_spec(name) is None]
    if not missing:
        return None
    if tuple(names) == EXPORTED_NEEDS:
        from packed_transformers.common.install_advice import pip_install

        return (
            f"{', '.join(missing)} not installed in this Python ({sys.executable}); an exported folder runs "
            f"with the light install: {pip_install(*EXPORTED_NEEDS)}"
        )
    return (
        f"{', '.join(missing)} not installed in this Python ({sys.executable}): this command needs the full "
        "install (pip install packed-transformers with its dependencies; in a clone: make install, then "
        ".venv/bin/python)"
    )


def json_input_mistake(option: str, value: str) -> str | None:
    """JSON lines (or SQuAD's JSON) start with "{": a file whose first non-blank character is
    something else (a CSV's header, plain text) is answered in one line. Only a regular file
    is looked at: opening a pipe would wait for its writer, and reading it would take the
    lines from the command."""
    if not Path(value).is_file():
        return None
    try:
        with open(value, "rb") as text:
            head = text.read(4096).lstrip()
    except OSError:
        return None  # unreadable: the command says why
    if not head or head.startswith(b"{"):
        return None
    first = head.splitlines()[0][:60].decode("utf-8", "replace")
    looks = "; it looks like CSV: convert it" if b"," in head.splitlines()[0] else ""
    return (
        f"{option} {value}:1: not JSON lines (it starts {first!r}); expected one JSON object per line, "
        f'such as {{"text": "..."}}{looks}'
    )


def device_mistake(argv: list[str]) -> str | None:
    """--device cuda with the CPU build of torch installed (its version says +cpu), read from
    the package's metadata, not by importing it."""
    if value_of(argv, "--device") != "cuda":
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("torch")
    except PackageNotFoundError:
        return None
    if "+cpu" not in installed:
        return None  # a CUDA build: whether it sees a GPU is for torch to say
    from packed_transformers.common.cli import no_gpu

    return no_gpu("--device cuda", installed, cuda_build=False)


def exit_on_path_mistakes(spec: dict[str, str], argv: list[str] | None = None) -> None:
    """Check the options of `spec` ({option: "folder" | "file" | "json" | "inputs"}; json: a
    file that must be JSON) and --device in `argv` (default
    sys.argv[1:]); print one line and exit 2 at the first mistake. --help is left alone.
    A Python without the project's packages is answered first, in one line."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        return
    from packed_transformers.common.choices import EXPORTED

    model = value_of(argv, "--model")
    exported = model is not None and (Path(model) / EXPORTED).is_file()
    missing = missing_packages(EXPORTED_NEEDS if exported else ("torch", "transformers"))
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        raise SystemExit(2)
    for option, kind in spec.items():
        value = value_of(argv, option)
        if value is None:
            continue
        mistake = path_mistake(option, value, "file" if kind == "json" else kind)
        if not mistake and kind == "json":
            mistake = json_input_mistake(option, value)
        if mistake:
            print(f"error: {mistake}", file=sys.stderr)
            raise SystemExit(2)
    mistake = device_mistake(argv)
    if mistake:
        print(f"error: {mistake}", file=sys.stderr)
        raise SystemExit(2)
