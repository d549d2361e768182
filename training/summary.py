"""`python -m training.summary --packed RUN --unpacked RUN`: packed vs unpacked, side by side.

Reads each run's metrics.jsonl and config.yaml (and the data's metadata.json) and prints
the packing factor, training throughput in real sequences and tokens per second (steps
after the first, to leave out start-up), the realized speed-up and the last eval accuracy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def run_figures(run: Path) -> dict:
    config = yaml.safe_load((run / "config.yaml").read_text())
    meta = json.loads((Path(config["data"]["train_dir"]) / "metadata.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    steady = train[1:] or train
    seconds = sum(r["sequences"] / r["sequences_per_second"] for r in steady)
    tokens = sum(r["tokens_per_second"] * r["sequences"] / r["sequences_per_second"] for r in steady)
    return {
        "run": str(run),
        "packing_factor": meta["packing_factor"],
        "steps": train[-1]["step"] if train else 0,
        "sequences": train[-1]["samples"] if train else 0,
        "sequences_per_second": sum(r["sequences"] for r in steady) / seconds if seconds else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "final_train_loss": train[-1]["loss"] if train else None,
        "eval_mlm_accuracy": evals[-1]["mlm_accuracy"] if evals else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packed", required=True, type=Path)
    parser.add_argument("--unpacked", required=True, type=Path)
    args = parser.parse_args(argv)
    packed, unpacked = run_figures(args.packed), run_figures(args.unpacked)
    print(
        "| run | packing factor | steps | sequences | sequences/s | real tokens/s | train loss | eval MLM acc |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, f in (("unpacked", unpacked), ("packed", packed)):
        acc = "-" if f["eval_mlm_accuracy"] is None else f"{f['eval_mlm_accuracy']:.4f}"
        print(
            f"| {name} | {f['packing_factor']:.3f} | {f['steps']} | {f['sequences']} | "
            f"{f['sequences_per_second']:.1f} | {f['tokens_per_second']:.0f} | {f['final_train_loss']:.3f} | {acc} |"
        )
    speedup = packed["sequences_per_second"] / unpacked["sequences_per_second"]
    print(
        f"\nrealized speed-up {speedup:.3f} (sequences/s packed / unpacked) = "
        f"{speedup / packed['packing_factor']:.3f} x packing factor {packed['packing_factor']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
