"""`packed rerank` against sentence-transformers' `CrossEncoder.predict`, each a whole process
(imports, loading, tokenizing, the forward, writing), on the same queries and candidates, the
same threads, fp32 (issue 109's inference goal).

    python bench/bench_rerank.py [--queries 50] [--candidates 20] [--rounds 3] [--threads 2]

The reranker: the MiniLM-L6 encoder as a one-label sequence-classification folder (its head new
and random, seed 0: speed and equality need no training; a trained cross-encoder of this size
costs the same). Queries: BBC News titles; each query's candidates: --candidates texts of mixed
length drawn from the corpus (a paragraph, a sentence or a title: data.embedding_texts' mixed
profile), the query's own article's body first. The peer is what a CrossEncoder user runs:
`CrossEncoder(folder).predict(pairs)` with its defaults (batch_size 32, its own length sorting,
padded batches, sigmoid), the scores written as JSON lines (`--peer` runs it: this file is its
own script). Rounds alternate the order of the two; each process's wall time is measured from
outside; the medians and the paired ratio are reported, and the two outputs' scores compared
(max absolute difference; the goal: within 1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def cross_encoder_peer(model_folder: str, input_path: str, output_path: str) -> None:
    """The peer, in its own process: CrossEncoder.predict over every (query, text) pair."""
    from sentence_transformers import CrossEncoder

    queries = [json.loads(line) for line in open(input_path, encoding="utf-8") if line.strip()]
    pairs = [(q["query"], text) for q in queries for text in q["texts"]]
    scores = CrossEncoder(model_folder, device="cpu").predict(pairs, show_progress_bar=False)
    with open(output_path, "w", encoding="utf-8") as out:
        first = 0
        for i, q in enumerate(queries):
            own = [float(s) for s in scores[first : first + len(q["texts"])]]
            first += len(q["texts"])
            out.write(json.dumps({"index": i, "scores": own}) + "\n")


def default_inputs(scratch: Path, queries: int, candidates: int) -> tuple[Path, Path]:
    """The MiniLM reranker folder and the queries' JSON lines (module docstring)."""
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    folder = scratch / "minilm_reranker"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(model_dir(), num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir()).save_pretrained(folder)
    articles = bbc_articles(corpus_glob())
    pool = [t for t in texts_of(articles, "mixed") if t.strip()]
    rng = np.random.default_rng(0)
    path = scratch / "queries.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for i in rng.choice(len(articles), size=min(queries, len(articles)), replace=False):
            others = [pool[j] for j in rng.choice(len(pool), size=candidates - 1, replace=False)]
            out.write(
                json.dumps({"query": articles[i]["title"], "texts": [articles[i]["body"], *others]}) + "\n"
            )
    return folder, path


def timed(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> int:
    from machine import description, line

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--candidates", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", nargs=3, metavar=("MODEL", "INPUT", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        cross_encoder_peer(*args.peer)
        return 0
    print(line(description()), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory(prefix="bench-rerank-") as scratch:
        scratch = Path(scratch)
        folder, queries = default_inputs(scratch, args.queries, args.candidates)
        ways = {
            "cross_encoder": [sys.executable, __file__, "--peer", str(folder), str(queries), str(scratch / "peer.jsonl")],
            "packed_rerank": [sys.executable, "-m", "packed_transformers", "rerank", "--model", str(folder), "--input",
                              str(queries), "--output", str(scratch / "packed.jsonl"), "--overwrite"],
        }  # fmt: skip
        seconds = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in list(ways) if r % 2 == 0 else list(reversed(ways)):
                seconds[name].append(timed(ways[name], env))
        peer = [json.loads(x)["scores"] for x in (scratch / "peer.jsonl").read_text().splitlines()]
        ours = [json.loads(x)["scores"] for x in (scratch / "packed.jsonl").read_text().splitlines()]
        difference = max(abs(a - b) for p, o in zip(peer, ours) for a, b in zip(p, o))
    pairs = args.queries * args.candidates
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    ratios = [p / o for p, o in zip(seconds["cross_encoder"], seconds["packed_rerank"])]
    print(f"\n# {args.queries} queries x {args.candidates} candidates ({pairs} pairs), {args.rounds} rounds, "
          f"{args.threads} threads, whole processes (medians)\n")  # fmt: skip
    print("| way | wall s | pairs/s |")
    print("|---|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value:.2f} | {pairs / value:.1f} |")
    print(f"\npacked rerank / CrossEncoder.predict: {statistics.median(ratios):.2f}x (paired median; "
          f"rounds {', '.join(f'{r:.2f}' for r in ratios)}); max score difference {difference:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
