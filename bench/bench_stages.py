"""The pipeline bubble on this machine: step time of one process vs 2-stage GPipe vs
2-stage 1F1B (torch.distributed.pipelining over gloo), same model, data and step.

    python bench/bench_stages.py [--preset bert-mini] [--seq 128] [--micro-batch 4] [--ga 8] [--steps 12]

All runs go through run_pretraining.py (the product path) on synthetic packed data and
read their step times from metrics.jsonl (the first 2 steps, warm-up, are left out).
One process gets as many threads as the two stage processes together, so the runs use
the same cores. With perfect threading, a 2-stage pipeline over M micro-batches takes
(M + S - 1) / M = (M + 1) / M of one process's step (the bubble), before communication.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from packed_transformers.common.constants import BERT_VOCAB_SIZE  # noqa: E402
from packed_transformers.data.synthetic import synthetic_rows  # noqa: E402
from packed_transformers.model import bert_config  # noqa: E402
from packed_transformers.packing.pipeline import PackJob, run_pack  # noqa: E402
from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard  # noqa: E402


def make_data(root: Path, seq: int, n: int) -> Path:
    rng = np.random.default_rng(0)
    rows = synthetic_rows(rng.integers(seq // 8, seq + 1, size=n), seq, 20, rng, vocab_size=BERT_VOCAB_SIZE)
    write_unpacked_shard(root / "raw.h5", rows)
    job = PackJob(
        inputs=(str(root / "raw.h5"),),
        output=str(root / "packed"),
        algorithm="lpfhp",
        max_sequences_per_pack=3,
        max_sequence_length=seq,
        max_predictions_per_seq=20,
        seed=1,
        shard_size=1000,
    )
    run_pack(job, quiet=True)
    return root / "packed"


def step_seconds(output: Path, skip: int = 2) -> float:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][skip:]
    return float(np.median([r["sequences"] / r["sequences_per_second"] for r in train]))


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="bert-mini")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--ga", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="cores in all (one process gets all)")
    args = parser.parse_args()
    layers = bert_config(args.preset).num_hidden_layers
    split = [layers // 2, layers - layers // 2]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_data(root, args.seq, 4000)
        runs = [
            ("one process", None, None, 1),
            ("2 stages GPipe", split, "gpipe", 2),
            ("2 stages 1F1B", split, "1f1b", 2),
        ]
        results = []
        for name, stages, schedule, procs in runs:
            config = {
                "model": {
                    "preset": args.preset,
                    "attention_backend": "sdpa",
                    "hidden_dropout": 0.0,
                    "attention_dropout": 0.0,
                },
                "data": {
                    "train_dir": str(data),
                    "micro_batch_packs": args.micro_batch,
                    "loader_workers": 0,
                    "max_sequence_length": args.seq,
                },
                "optim": {
                    "gradient_accumulation": args.ga,
                    "packing_adjustment": "none",
                    "total_samples": 1e9,
                },
                "training": {"max_steps": args.steps, "log_every_steps": 1},
                "eval": {"at_end": False},
                "execution": {
                    "device": "cpu",
                    "threads": max(1, args.threads // procs),
                    "layers_per_stage": stages,
                }
                | ({"pipeline_schedule": schedule} if schedule else {}),
                "logging": {"progress": False, "tensorboard": False, "mlperf": False},
            }
            path = root / f"{len(results)}.yaml"
            path.write_text(yaml.safe_dump(config))
            out = root / f"out{len(results)}"
            cmd = (
                [sys.executable, "run_pretraining.py"]
                if procs == 1
                else [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    str(procs),
                    "--master-port",
                    "29631",
                    "run_pretraining.py",
                ]
            )
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, args.threads // procs)))
            done = subprocess.run(
                cmd + ["--config", str(path), "--output-dir", str(out)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            results.append((name, step_seconds(out)))
    base = results[0][1]
    m = args.ga
    print(
        f"{args.preset}, S={args.seq}, micro-batch {args.micro_batch} packs, {m} micro-batches per step, {args.threads} cores"
    )
    print("| run | step s (median) | vs one process | bubble-only bound |")
    print("|---|---|---|---|")
    for name, seconds in results:
        ideal = "" if name == "one process" else f"{(m + 1) / m:.3f}"
        print(f"| {name} | {seconds:.3f} | {seconds / base:.3f} | {ideal} |")


if __name__ == "__main__":
    main()
