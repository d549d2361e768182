"""The /embed bench's two policies at saturation, without HTTP: where the time goes.

    python bench/profile_policies.py [--batches 12] [--queue 512] [--threads 2]

A full queue of BBC News texts (titles, sentences, paragraphs: bench_serve's embed
workload) is drained batch by batch by each policy (serving/policies.py: `plan_batch`, the
same decision the server makes) and each batch is run by the server's engine, timed.
Printed per policy: sequences, rows and width per batch, real-token fraction, real
tokens/s, and torch's operator profile (attention, dense layers, the rest), so a ratio
between policies can be read as padding x attention width x everything else.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of
    from packed_transformers.serving.api import Request
    from packed_transformers.serving.engines import load_engine
    from packed_transformers.serving.policies import PolicySettings, plan_batch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--queue", type=int, default=512, help="sequences waiting (saturation)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--k", type=int, default=6, help="packed: sequences per row at most (--max-sequences-per-pack)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(model_dir(), attention_backend="sdpa")
    texts = texts_of(bbc_articles(corpus_glob()), "mixed")
    rng = np.random.default_rng(0)
    texts = [texts[i] for i in rng.choice(len(texts), 4000, replace=False)]
    prepared = engine.prepare(Request("embed", texts, truncate=True, options={"normalize": True}))
    ids = prepared.token_ids
    print(
        f"# {len(ids)} texts, queue of {args.queue}, {args.batches} batches per policy, {args.threads} threads"
    )
    print(
        "| policy | sequences / batch | rows x width | real-token fraction | real tokens/s | attention share | dense share |"
    )
    print("|---|---|---|---|---|---|---|")
    for policy in ("fifo-tokens", "packed"):
        settings = PolicySettings(policy, max_length=engine.max_length, max_sequences_per_pack=args.k)
        order = rng.permutation(len(ids))
        queue = list(order[: args.queue])
        refill = itertools.cycle(order)
        shapes, real, slots, seconds, sequences = [], 0, 0, 0.0, 0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.batches):
                lengths = np.array([len(ids[i]) for i in queue])
                plan = plan_batch(lengths, np.zeros(len(queue)), settings)
                chosen = [queue[i] for i in plan.chosen]
                batch_ids = [ids[i] for i in chosen]
                started = time.perf_counter()
                engine.run(batch_ids, [np.zeros_like(t) for t in batch_ids], plan.table, plan.width)
                seconds += time.perf_counter() - started
                shapes.append((len(plan.table), plan.width))
                real += int(sum(len(t) for t in batch_ids))
                slots += len(plan.table) * plan.width
                sequences += len(chosen)
                taken = set(plan.chosen.tolist())
                queue = [q for i, q in enumerate(queue) if i not in taken] + [next(refill) for _ in chosen]
        totals = {}
        for event in prof.key_averages():
            totals[event.key] = event.self_cpu_time_total
        all_time = sum(totals.values())
        attention = sum(v for k, v in totals.items() if "attention" in k or "softmax" in k or "bmm" in k)
        dense = sum(
            v for k, v in totals.items() if k in ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul")
        )
        rows = np.mean([r for r, _ in shapes])
        width = np.mean([w for _, w in shapes])
        print(f"| {policy} | {sequences / args.batches:.0f} | {rows:.0f} x {width:.0f} | {real / slots:.3f} | "
              f"{real / seconds:,.0f} | {attention / all_time:.0%} | {dense / all_time:.0%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
