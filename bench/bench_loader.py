"""Is data loading ever the bottleneck? Loader rate vs bert-base training rate, one run.

    python bench/bench_loader.py [--packed demo_out/packed] [--micro-batch 8] [--workers 1]

Measures (1) the training DataLoader alone (PackedShards + ReplicaSampler, real
sequences/s) and (2) full bert-base training steps on CPU with the same micro-batch,
side by side, and prints the ratio (goal: loader >= 5x training).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from packed_transformers.components.data import LoaderPosition, PackedShards, ReplicaSampler, make_loader  # noqa: E402
from packed_transformers.model import PackedBertForPreTraining, bert_config  # noqa: E402
from packed_transformers.optim import Lamb, weight_decay_groups  # noqa: E402
from packed_transformers.packing.shards import PackedDataset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.splitlines()[0]
    )
    parser.add_argument("--packed", type=Path, default=REPO / "demo_out" / "packed")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--loader-batches", type=int, default=200)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument(
        "--preset", default="bert-base", help="the model trained beside the loader (bert-mini: a smoke)"
    )
    args = parser.parse_args()
    dataset = PackedDataset.open(args.packed)
    shards = PackedShards(dataset)
    sampler = ReplicaSampler(len(shards), args.micro_batch, 1, 0, 1, LoaderPosition())
    loader = iter(make_loader(shards, sampler, args.workers))
    first = next(loader)  # start-up (worker fork) excluded
    t0, sequences = time.perf_counter(), 0
    for _ in range(args.loader_batches):
        sequences += int(next(loader)["next_sentence_weights"].sum())
    loader_rate = sequences / (time.perf_counter() - t0)

    model = PackedBertForPreTraining(bert_config(args.preset, attention_backend="sdpa"))
    optimizer = Lamb(weight_decay_groups(model.named_parameters(), 0.01), lr=1e-4)
    batch = first
    times = []
    for _ in range(args.train_steps + 1):
        t = time.perf_counter()
        out = model(**batch)
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    train_rate = int(batch["next_sentence_weights"].sum()) / (sum(times[1:]) / args.train_steps)
    print(
        f"\n{args.packed} (packing factor {dataset.metadata['packing_factor']:.3f}), micro-batch {args.micro_batch} packs,"
        f" {args.workers} loader worker(s), {torch.get_num_threads()} torch threads\n"
    )
    print("| what | sequences/s |")
    print("|---|---|")
    print(f"| DataLoader alone | {loader_rate:,.0f} |")
    print(f"| {args.preset} training step (CPU) | {train_rate:,.1f} |")
    print(f"| ratio | {loader_rate / train_rate:,.0f}x |")


if __name__ == "__main__":
    main()
