"""Side-by-side table of fine-tuning runs (their OUTPUT/summary.json), ratios against padded.

python -m finetune.report runs/bbc_padded runs/bbc_dynamic runs/bbc_uniform runs/bbc_packed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(folder: Path) -> dict:
    path = folder / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected a finished `python -m finetune.train` run")
    return json.loads(path.read_text())


def table(summaries: list[dict]) -> str:
    base = next((s for s in summaries if s["batching"] == "padded"), None)

    def ratio(s, key):
        return f" ({s[key] / base[key]:.2f}x)" if base else ""

    lines = [
        "| batching | train examples/s | inference examples/s | padding train / inference "
        "| examples per row | validation accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['batching']} | {s['train_examples_per_second']:.1f}{ratio(s, 'train_examples_per_second')} "
            f"| {s['inference_examples_per_second']:.1f}{ratio(s, 'inference_examples_per_second')} "
            f"| {s['train_padding_fraction']:.1%} / {s['inference_padding_fraction']:.1%} "
            f"| {s['examples_per_row']:.2f} | {s['validation_accuracy']:.2%} |"
        )
    if base:
        lines.append("")
        lines.append(
            "(x) = ratio to fixed padding. Validation accuracy difference to padded: "
            + ", ".join(
                f"{s['batching']} {100 * (s['validation_accuracy'] - base['validation_accuracy']):+.2f} points"
                for s in summaries
                if s is not base
            )
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="finetune.train output folders")
    folders = parser.parse_args(argv).runs
    try:
        summaries = [load(f) for f in folders]
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
