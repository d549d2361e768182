"""Packed vs padded BERT training throughput on sequences drawn from the Wikipedia-512
length histogram, same model, same micro-batch of rows, measured alternately in one run.

    python bench/bench_model.py [--preset bert-base] [--rows 4] [--steps 3]

* overhead: time per row of packed rows vs the same model fed one sequence per row at
  the same shape (S tokens/row); the packed path adds mask building and K/M gathers.
* realized speed-up: sequences/s packed / sequences/s padded (one sequence per row).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from packed_transformers.model import PackedBertForPreTraining, bert_config  # noqa: E402
from packed_transformers.packing import Histogram, pack  # noqa: E402
from packed_transformers.packing.format import Sequence, pack_sequences  # noqa: E402

HIST = (
    Path(__file__).resolve().parent.parent
    / "packed_transformers"
    / "packing"
    / "histograms"
    / "wikipedia_512.json"
)


def sample_rows(rng, plan, rows, s, k, m, vocab, packed):
    """`rows` packs drawn from the plan's strategies (weighted by count), or, unpacked,
    `rows` single sequences with lengths drawn from the same packs."""
    probabilities = plan.counts / plan.counts.sum()
    chosen = rng.choice(len(plan.strategies), size=rows, p=probabilities)
    lengths_per_row = [list(plan.strategies[i]) for i in chosen]
    if not packed:
        lengths_per_row = [[length] for length in sum(lengths_per_row, [])][:rows]
    packs = []
    for lengths in lengths_per_row:
        seqs = []
        for length in lengths:
            ids = rng.integers(5, vocab, size=length)
            p = max(1, min(round(0.15 * length), m // k, length - 1)) if length > 1 else 0
            positions = (
                np.sort(rng.choice(np.arange(1, length), size=p, replace=False)) if p else np.array([], int)
            )
            seqs.append(Sequence(ids, np.zeros(length, int), positions, rng.integers(5, vocab, size=p), 0))
        packs.append(seqs)
    arrays = pack_sequences(packs, s, k, m, vocab)
    return {n: torch.from_numpy(a.astype(np.int64)) for n, a in arrays.items()}


def time_step(model, batch, optimizer):
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(**batch)["loss"].backward()
    optimizer.step()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="bert-base")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="sdpa")
    args = parser.parse_args()
    s, k, m = 512, 3, 76
    plan = pack(Histogram.from_json_file(HIST), "lpfhp", k)
    torch.manual_seed(0)
    config = bert_config(args.preset, attention_backend=args.backend)
    model = PackedBertForPreTraining(config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    rng = np.random.default_rng(0)
    times = {"packed": [], "padded": []}
    sequences = {"packed": [], "padded": []}
    batches = {
        kind: [
            sample_rows(rng, plan, args.rows, s, k, m, config.vocab_size, kind == "packed")
            for _ in range(args.steps + 1)
        ]
        for kind in times
    }
    for kind in times:  # warm-up step each
        time_step(model, batches[kind][0], optimizer)
    for step in range(1, args.steps + 1):
        for kind in times:
            batch = batches[kind][step]
            times[kind].append(time_step(model, batch, optimizer))
            sequences[kind].append(int(batch["next_sentence_weights"].sum()))
    print(
        f"model {args.preset} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
        f"backend {args.backend}, {args.rows} rows x {s} tokens, {args.steps} steps, "
        f"threads {torch.get_num_threads()}; plan lpfhp K=3 packing factor {plan.packing_factor:.3f}"
    )
    per_row = {kind: statistics.median(t) / args.rows for kind, t in times.items()}
    rate = {kind: sum(sequences[kind]) / sum(times[kind]) for kind in times}
    print("| mode | s per row (median step / rows) | sequences/s |\n|---|---|---|")
    for kind in times:
        print(f"| {kind} | {per_row[kind]:.3f} | {rate[kind]:.2f} |")
    print(f"packing overhead per row: {100 * (per_row['packed'] / per_row['padded'] - 1):+.1f}%")
    speedup = rate["packed"] / rate["padded"]
    sampled_factor = sum(sequences["packed"]) / (args.rows * args.steps)
    print(
        f"realized speed-up: {speedup:.3f} = {speedup / sampled_factor:.3f} x the packing factor of "
        f"the sampled packs ({sampled_factor:.3f}; plan average {plan.packing_factor:.3f})"
    )


if __name__ == "__main__":
    main()
