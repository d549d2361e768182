"""Attention backends side by side on packs: attention alone and the whole training step.

    python bench/bench_attention.py [--preset bert-mini] [--rows 8] [--repeats 5] [--lengths 128 512]

Packs are drawn from the Wikipedia-512 length histogram (LPFHP, K=3); for S=128 the
histogram is scaled down by 4 (length l -> ceil(l/4)). Every backend runs on the same
batches, interleaved round by round (machines here are noisy); the table gives the
median time of forward + backward, and the ratio to dense. FlexAttention has no backward
on CPU (torch 2.13): its rows are forward only, marked so.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import HIST, sample_rows  # noqa: E402

from packed_transformers.model import ATTENTION_BACKENDS, PackedBertForPreTraining, bert_config  # noqa: E402
from packed_transformers.model.attention import PackedSelfAttention, build_mask  # noqa: E402
from packed_transformers.packing import Histogram, pack  # noqa: E402


def histogram_for(length: int) -> Histogram:
    wiki = Histogram.from_json_file(HIST)
    if length == wiki.max_sequence_length:
        return wiki
    factor = wiki.max_sequence_length // length
    lengths = -(-wiki.lengths // factor)  # ceil
    counts = np.bincount(lengths - 1, weights=wiki.counts, minlength=length).astype(np.int64)
    return Histogram(counts)


def timed(fn, backward: bool) -> float:
    start = time.perf_counter()
    out = fn()
    if backward:
        out.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", default="bert-mini", help="model of the whole-step rows")
    parser.add_argument("--rows", type=int, default=8, help="packs per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--backends", nargs="+", default=list(ATTENTION_BACKENDS), choices=ATTENTION_BACKENDS)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"# {args.rows} packs per batch, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| S | what | backend | ms (median) | vs dense |")
    print("|---|---|---|---|---|")
    for s in args.lengths:
        k, m = 3, max(8, round(0.15 * s) * 3 // 2)
        plan = pack(histogram_for(s), "lpfhp", k)
        torch.manual_seed(0)
        config = bert_config(args.preset, attention_probs_dropout_prob=0.1)
        batches = [sample_rows(rng, plan, args.rows, s, k, m, config.vocab_size, True) for _ in range(3)]
        hidden = torch.randn(args.rows, s, config.hidden_size)
        rows = {}
        for what in ("attention", "step"):
            times = {b: [] for b in args.backends}
            modules = {}
            for backend in args.backends:
                cfg = bert_config(args.preset, attention_probs_dropout_prob=0.0 if backend == "flex" else 0.1)
                cfg.attention_backend = backend
                torch.manual_seed(0)
                if what == "attention":
                    modules[backend] = PackedSelfAttention(cfg).train()
                else:
                    modules[backend] = PackedBertForPreTraining(cfg).train()
            for r in range(args.repeats + 1):
                for backend in (
                    args.backends[r % len(args.backends) :] + args.backends[: r % len(args.backends)]
                ):
                    module, batch = modules[backend], batches[r % len(batches)]
                    backward = backend != "flex"
                    if what == "attention":
                        x = hidden.clone().requires_grad_(backward)

                        def fn(module=module, backend=backend, batch=batch, x=x, k=k):
                            mask = build_mask(backend, batch["sequence_ids"], x.dtype, k)
                            return module(x, mask).square().mean()
                    else:

                        def fn(module=module, batch=batch):
                            return module(**batch)["loss"]

                    with torch.set_grad_enabled(backward):
                        seconds = timed(fn, backward)
                    module.zero_grad(set_to_none=True)
                    if r:  # round 0 warms up
                        times[backend].append(seconds)
            for backend in args.backends:
                rows[(what, backend)] = statistics.median(times[backend])
            for backend in args.backends:
                ms = 1000 * rows[(what, backend)]
                ratio = (
                    rows[(what, "dense")] / rows[(what, backend)]
                    if "dense" in args.backends
                    else float("nan")
                )
                label = f"{what} ({args.preset})" if what == "step" else "attention alone"
                note = " (forward only)" if backend == "flex" else ""
                print(f"| {s} | {label} | {backend}{note} | {ms:.1f} | {ratio:.2f}x |")
        factor = sum(int(b["next_sentence_weights"].sum()) for b in batches) / (3 * args.rows)
        print(f"| {s} | packing factor of the sampled packs | | {factor:.2f} | |")


if __name__ == "__main__":
    main()
