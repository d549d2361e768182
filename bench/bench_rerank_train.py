"""Reranker training inside sentence-transformers' own `CrossEncoderTrainer`, packed in place
(`pack_cross_encoder`, one line) against the same script as its users run it, each a whole
process (imports, loading, training, saving), the same pairs, threads and seed, fp32 (issue
109's training goal: >= 1.5x, quality equal).

    python bench/bench_rerank_train.py [--pairs 1000] [--rounds 3] [--threads 2] [--batch-size 16] [--lr 2e-5]

The reranker: MiniLM-L6's encoder as a CrossEncoder with a new one-logit head (seed 0). Pairs:
BBC News titles as queries, each with its own article's first two paragraphs (label 1) and
another article's (label 0), cut at 256 tokens as the CrossEncoder's max_length: a short query
joined to a passage of mixed length. One epoch of BinaryCrossEntropyLoss, AdamW at 2e-5 with
the trainer's defaults otherwise (its batch sampler, its collator's padding to the longest
pair), then `model.save_pretrained`. Both scripts are this file (`--worker plain|packed`).

Round r trains both ways from seed r (the head's initial weights and the trainer's shuffling), so
the rounds are also three draws of the training's own randomness. Quality: each saved reranker
orders the candidates of --eval-queries held-out titles (its own article's passage among 9
others'): MRR@10 and nDCG@10 (one relevant passage), per round and their mean over the rounds
(one run's nDCG@10 moves by points with the seed after a few dozen steps: the mean is what is
compared), and round 0's two models' scores compared (max absolute difference: packing changes
where a pair sits, not the arithmetic). Reported: wall seconds per process, medians, the paired ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_pairs(pairs: int, eval_queries: int, scratch: Path) -> tuple[Path, Path]:
    """The training pairs and the held-out reranking queries as JSON lines (module docstring)."""
    import numpy as np

    from packed_transformers.data.assets import corpus_glob
    from packed_transformers.data.embedding_texts import bbc_articles, pairs_of

    rng = np.random.default_rng(0)
    found = pairs_of(bbc_articles(corpus_glob()))
    order = rng.permutation(len(found))
    held, train = order[:eval_queries], order[eval_queries:]
    lines = []
    for i in train[: pairs // 2]:
        other = train[(np.searchsorted(train, i) + 1 + rng.integers(len(train) - 1)) % len(train)]
        lines.append({"query": found[i]["anchor"], "passage": found[i]["positive"], "label": 1.0})
        lines.append({"query": found[i]["anchor"], "passage": found[other]["positive"], "label": 0.0})
    train_file = scratch / "pairs.jsonl"
    train_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    queries = []
    for i in held:
        others = [found[j]["positive"] for j in rng.choice(held[held != i], 9, replace=False)]
        queries.append({"query": found[i]["anchor"], "texts": [found[i]["positive"], *others]})
    eval_file = scratch / "queries.jsonl"
    eval_file.write_text("".join(json.dumps(q) + "\n" for q in queries))
    return train_file, eval_file


def worker(way: str, train_file: str, output: str, batch_size: int, lr: float, seed: int) -> None:
    """One whole training process, as a CrossEncoderTrainer user writes it (+1 line packed)."""
    import torch
    from datasets import Dataset
    from sentence_transformers.cross_encoder import (
        CrossEncoder,
        CrossEncoderTrainer,
        CrossEncoderTrainingArguments,
        losses,
    )

    from packed_transformers.data.assets import model_dir

    started = time.perf_counter()
    torch.manual_seed(seed)
    model = CrossEncoder(str(model_dir()), num_labels=1, max_length=256, device="cpu")
    if way == "packed":
        from packed_transformers.hf_integration.st_packing import pack_cross_encoder

        packing = pack_cross_encoder(model)
    rows = [json.loads(line) for line in open(train_file, encoding="utf-8")]
    dataset = Dataset.from_dict({key: [r[key] for r in rows] for key in ("query", "passage", "label")})
    args = CrossEncoderTrainingArguments(
        output_dir=output + ".trainer", num_train_epochs=1, per_device_train_batch_size=batch_size,
        learning_rate=lr, seed=seed, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_steps=10**9,
    )  # fmt: skip
    CrossEncoderTrainer(
        model=model, args=args, train_dataset=dataset, loss=losses.BinaryCrossEntropyLoss(model)
    ).train()
    model.save_pretrained(output)
    report = {"seconds_inside": time.perf_counter() - started}
    if way == "packed":
        report["padding"] = packing.padding
    print(json.dumps(report))


def quality(folder: str, eval_file: Path) -> tuple[dict, list[float]]:
    """MRR@10, nDCG@10 of a saved reranker over the held-out queries, and its scores."""
    from sentence_transformers.cross_encoder import CrossEncoder

    model = CrossEncoder(folder, device="cpu")
    queries = [json.loads(line) for line in open(eval_file, encoding="utf-8")]
    mrr = ndcg = 0.0
    scores = []
    for q in queries:
        own = model.predict([(q["query"], t) for t in q["texts"]], show_progress_bar=False).tolist()
        scores += own
        rank = 1 + sum(s > own[0] for s in own[1:])  # the relevant passage is texts[0]
        mrr += 1 / rank if rank <= 10 else 0.0
        ndcg += 1 / math.log2(rank + 1) if rank <= 10 else 0.0
    return {"mrr@10": round(mrr / len(queries), 4), "ndcg@10": round(ndcg / len(queries), 4)}, scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--eval-queries", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW's learning rate (the recipe's: 5e-5)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", choices=("plain", "packed"), help=argparse.SUPPRESS)
    parser.add_argument("--train-file", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.train_file, args.output, args.batch_size, args.lr, args.seed)
        return 0
    from packed_transformers.data.assets import model_label

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    walls: dict[str, list[float]] = {"plain": [], "packed": []}
    padding = None
    with tempfile.TemporaryDirectory() as scratch:
        train_file, eval_file = make_pairs(args.pairs, args.eval_queries, Path(scratch))
        for round_ in range(args.rounds):
            for way in ("plain", "packed") if round_ % 2 == 0 else ("packed", "plain"):
                output = str(Path(scratch) / f"{way}-{round_}")
                started = time.perf_counter()
                done = subprocess.run([sys.executable, __file__, "--worker", way, "--train-file", str(train_file),
                                       "--output", output, "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(round_)], env=env, cwd=REPO,
                                      capture_output=True, text=True)  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"{way} exited {done.returncode}: {done.stderr[-3000:]}")
                walls[way].append(time.perf_counter() - started)
                padding = json.loads(done.stdout.strip().splitlines()[-1]).get("padding", padding)
                print(f"round {round_} {way}: {walls[way][-1]:.1f} s", file=sys.stderr, flush=True)
        found = {way: [quality(str(Path(scratch) / f"{way}-{r}"), eval_file) for r in range(args.rounds)]
                 for way in walls}  # fmt: skip
    ratios = [p / q for p, q in zip(walls["plain"], walls["packed"])]
    difference = max(abs(a - b) for a, b in zip(found["plain"][0][1], found["packed"][0][1]))
    mean = {way: {k: round(statistics.mean(f[0][k] for f in found[way]), 4) for k in ("mrr@10", "ndcg@10")}
            for way in walls}  # fmt: skip
    print(f"# CrossEncoderTrainer, {args.pairs} pairs, batch {args.batch_size}, lr {args.lr}, 1 epoch, {args.threads} threads, "
          f"{model_label()}; whole processes (load, train, save), {args.rounds} rounds (seed = round)")  # fmt: skip
    print("| way | wall s (rounds) | median | nDCG@10 (rounds) | mean MRR@10 | mean nDCG@10 |")
    print("|---|---|---|---|---|---|")
    for way, times in walls.items():
        print(f"| {way} | {', '.join(f'{t:.1f}' for t in times)} | {statistics.median(times):.1f} | "
              f"{', '.join(str(f[0]['ndcg@10']) for f in found[way])} | {mean[way]['mrr@10']} | "
              f"{mean[way]['ndcg@10']} |")  # fmt: skip
    print(f"\npacked / plain, paired per round: {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
          f"padding of the plain batches {padding and round(padding['padded'], 3)}, of the packed rows "
          f"{padding and round(padding['packed'], 3)}; mean nDCG@10 packed - plain "
          f"{mean['packed']['ndcg@10'] - mean['plain']['ndcg@10']:+.4f}; round 0's held-out scores' max "
          f"difference {difference:.2e}")  # fmt: skip
    if args.json:
        from bench.machine import description

        args.json.write_text(json.dumps({
            "command": "python bench/bench_rerank_train.py " + " ".join(sys.argv[1:]), "machine": description(),
            "walls": walls, "quality": {w: [q[0] for q in f] for w, f in found.items()}, "mean_quality": mean,
            "round0_max_score_difference": difference,
            "padding": padding}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
