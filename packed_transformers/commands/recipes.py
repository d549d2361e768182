"""packed recipes: the README's configs and examples written into a folder, to run and edit.

    packed recipes [--output .]       # writes ./configs/ and ./examples/

What a pip user lacks in an empty folder: the configs every `packed train` / `packed pretrain`
recipe names (`configs/*.yaml` and configs/README.md, every key documented) and the examples'
inputs and scripts (`examples/classify/new_texts.jsonl`, `examples/sft/train.jsonl`,
`examples/trainer/classify_with_trainer.py`), as installed with the package (common.recipes).
After it, every README command runs as written from that folder. A config named by its README
path also runs without it (the installed copy is read, and the command says so).

Each folder appears whole or not at all (written aside, then renamed in). An existing
configs/ or examples/ is never replaced: the command refuses in one line before writing
anything, so edited configs are never lost. Prints one JSON line: what was written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from packed_transformers.common.cli import refuse
from packed_transformers.common.files import atomic_folder, describe_os_error
from packed_transformers.common.recipes import CONFIGS, EXAMPLES, shipped_config_names

WRITTEN = {"configs": CONFIGS, "examples": EXAMPLES}  # folder written -> its installed source


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(
        prog="packed recipes", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )  # fmt: skip
    made.add_argument("--output", type=Path, default=Path("."),
                      help="the folder configs/ and examples/ are written into (default: here)")  # fmt: skip
    return made


def ignored(folder: str, names: list[str]) -> list[str]:
    """What of the installed folders is not a recipe (byte-code caches)."""
    return [name for name in names if name == "__pycache__" or name.endswith(".pyc")]


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.output.exists() and not args.output.is_dir():
        return refuse(f"--output {args.output}: not a folder")
    present = [name for name in WRITTEN if (args.output / name).exists() or (args.output / name).is_symlink()]
    if present:
        return refuse(f"--output {args.output}: {present[0]}/ exists; nothing was written (move it aside, or "
                      "give another --output)")  # fmt: skip
    try:
        for name, source in WRITTEN.items():
            with atomic_folder(args.output / name) as folder:
                shutil.copytree(source, folder, dirs_exist_ok=True, ignore=ignored)
    except OSError as err:
        return refuse(describe_os_error(err, f"--output {args.output}"))
    examples = sorted(
        p.relative_to(args.output).as_posix() for p in (args.output / "examples").rglob("*") if p.is_file()
    )
    print(json.dumps({"output": str(args.output), "configs": shipped_config_names(), "examples": examples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
