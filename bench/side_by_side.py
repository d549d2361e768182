"""Whole-process predict and embed of two checkouts, interleaved: a refactor's check that
outputs and speed did not change (docs/house.md).

    git worktree add /tmp/old f804ecc
    python bench/side_by_side.py --old /tmp/old --texts texts.jsonl --embed-model MINILM \
        --predict-model CLASSIFIER [--rounds 3]

Each tree runs as `python -m packed_transformers.finetune.embed` / `finetune.predict` with PYTHONPATH set to it
(move .venv's editable-install .pth aside first: its finder would map every room to this
checkout). The order alternates every round; outputs are compared at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the other checkout")
    parser.add_argument("--texts", type=Path, required=True, help="JSON lines with a text field")
    parser.add_argument("--embed-model", required=True)
    parser.add_argument("--predict-model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", type=Path, default=Path("bench_out/side_by_side"))
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": Path(__file__).resolve().parents[1]}
    args.scratch.mkdir(parents=True, exist_ok=True)
    seconds = {name: {"embed": [], "predict": []} for name in trees}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for job in ("embed", "predict"):
            for name in order:
                out = args.scratch / f"{name}_{job}.{'npy' if job == 'embed' else 'jsonl'}"
                out.unlink(missing_ok=True)
                model = args.embed_model if job == "embed" else args.predict_model
                argv = [sys.executable, "-m", f"packed_transformers.finetune.{job}", "--model", model, "--input", str(args.texts),
                        "--output", str(out.resolve())] + (["--quiet"] if job == "embed" else [])  # fmt: skip
                started = time.perf_counter()
                done = subprocess.run(argv, cwd=trees[name], env=dict(os.environ, PYTHONPATH=str(trees[name])),
                                      capture_output=True, text=True)  # fmt: skip
                if done.returncode:
                    print(f"{name} {job}: {done.stderr[-2000:]}", file=sys.stderr)
                    return 1
                seconds[name][job].append(round(time.perf_counter() - started, 2))
    old_vectors, new_vectors = (np.load(args.scratch / f"{n}_embed.npy") for n in trees)
    old_lines, new_lines = ([json.loads(x) for x in open(args.scratch / f"{n}_predict.jsonl")] for n in trees)
    print(json.dumps({
        "seconds": seconds,
        "embed_max_abs_difference": float(np.abs(old_vectors - new_vectors).max()),
        "predict_equal_labels": sum(a["label"] == b["label"] for a, b in zip(old_lines, new_lines)),
        "predict_max_score_difference": max(abs(a["scores"][k] - b["scores"][k])
                                            for a, b in zip(old_lines, new_lines) for k in a["scores"]),
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
