"""Side-by-side table of fine-tuning runs (their OUTPUT/summary.json), ratios against padded.

packed report runs/bbc_padded runs/bbc_dynamic runs/bbc_uniform runs/bbc_packed
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from packed_transformers.common.cli import refuse


def load(folder: Path) -> dict:
    path = folder / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not found; expected a finished `python -m packed_transformers.finetune.train` run"
        )
    return json.loads(path.read_text())


QUALITY = {  # task -> (column title, summary keys shown, the key compared with padded)
    "classification": ("validation accuracy", ("validation_accuracy",), "validation_accuracy"),
    "question_answering": (
        "validation EM / F1",
        ("validation_exact_match", "validation_f1"),
        "validation_f1",
    ),
}


def quality(s: dict) -> tuple[str, float]:
    """(cell text, compared value) of a run's validation quality, by its task."""
    keys = QUALITY[s.get("task", "classification")][1]
    if s.get("task") == "question_answering" and "validation_exact" in s:  # v2.0's keys
        keys = ("validation_exact", "validation_f1")
    values = [s[k] for k in keys]
    if len(values) == 1:
        return f"{values[0]:.2%}", 100 * values[0]
    return " / ".join(f"{v:.2f}" for v in values), values[-1]


def table(summaries: list[dict]) -> str:
    base = next((s for s in summaries if s["batching"] == "padded"), None)
    title = QUALITY[summaries[0].get("task", "classification")][0]

    def ratio(s, key):
        return f" ({s[key] / base[key]:.2f}x)" if base else ""

    lines = [
        "| batching | train examples/s | inference examples/s | padding train / inference "
        f"| examples per row | {title} |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['batching']} | {s['train_examples_per_second']:.1f}{ratio(s, 'train_examples_per_second')} "
            f"| {s['inference_examples_per_second']:.1f}{ratio(s, 'inference_examples_per_second')} "
            f"| {s['train_padding_fraction']:.1%} / {s['inference_padding_fraction']:.1%} "
            f"| {s['examples_per_row']:.2f} | {quality(s)[0]} |"
        )
    if base:
        lines.append("")
        lines.append(
            f"(x) = ratio to fixed padding. {title.split(' / ')[-1].replace('validation EM', 'F1')} "
            "difference to padded: "
            + ", ".join(
                f"{s['batching']} {quality(s)[1] - quality(base)[1]:+.2f} points"
                for s in summaries
                if s is not base
            )
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    from packed_transformers.common.cli import command_parser

    parser = command_parser("packed report", __doc__)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="finetune.train output folders")
    folders = parser.parse_args(argv).runs
    try:
        summaries = [load(f) for f in folders]
    except FileNotFoundError as err:
        return refuse(err)
    print(table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
