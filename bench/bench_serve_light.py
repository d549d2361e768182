"""Latency at a light load: policies on the same Poisson arrivals, side by side.

    python bench/bench_serve_light.py [--workload embed] [--rate 7.5] [--seconds 60] [--rounds 2]

bench_serve.py's load points are one --seconds run per policy, so their p99 is about the
second-worst of ~100 requests: noise decides it. Here every policy in a round gets the
same arrival times and the same texts (the round's seed), the policies' order alternates
between rounds, and each round runs --seconds (a fresh `python -m packed_transformers.serving` per policy and
round, warmed with 5 s of the same load). Prints p50 / p99 (ms) per policy and round, and
the mean sequences per batch from the server's /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_serve  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="default: the workload's (see bench_serve.py)")
    parser.add_argument("--workload", default="embed", choices=tuple(bench_serve.ROUTE))
    parser.add_argument("--rate", type=float, default=7.5, help="requests per second (Poisson)")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--policies", nargs="+", default=["packed", "fifo-tokens"], choices=bench_serve.POLICIES
    )
    parser.add_argument("--server-args", default="--attention-backend sdpa")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bench_serve.route = bench_serve.ROUTE[args.workload]
    if args.workload == "embed":
        from packed_transformers.data.assets import model_dir

        texts, model = bench_serve.embed_texts(), args.model or model_dir()
    else:
        if args.model is None:
            parser.error("--model: a finetune.train folder for the pairs and mixed workloads")
        texts, model = bench_serve.bbc_texts(args.workload), args.model
    bodies = bench_serve.encode_requests(texts)
    print("| round | policy | p50 ms | p99 ms | requests | sequences per batch |\n|---|---|---|---|---|---|")
    for round_ in range(args.rounds):
        order = args.policies if round_ % 2 == 0 else args.policies[::-1]
        for policy in order:
            with bench_serve.ServerProcess(model, policy, args.server_args.split()) as server:
                asyncio.run(bench_serve.open_loop(server.port, bodies, args.rate, 5, seed=10_000 + round_))
                result = asyncio.run(
                    bench_serve.open_loop(server.port, bodies, args.rate, args.seconds, seed=round_)
                )
                metrics = server.metrics()
            per_batch = metrics["packed_batch_sequences_sum"] / metrics["packed_batches_total"]
            print(f"| {round_} | {policy} | {result['p50'] * 1000:.0f} | {result['p99'] * 1000:.0f} | "
                  f"{result['sent']} | {per_batch:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
