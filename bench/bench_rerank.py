"""`packed rerank` against sentence-transformers' `CrossEncoder.predict`, each a whole process
(imports, loading, tokenizing, the forward, writing), on the same queries and candidates, the
same threads, fp32 (issue 109's inference goal).

    python bench/bench_rerank.py [--queries 50] [--candidates 20] [--rounds 3] [--threads 2] [--peers openvino]

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

--peers openvino adds the fastest runtime a CrossEncoder user picks on a CPU:
`CrossEncoder(folder, backend="openvino")` (sentence-transformers' OpenVINO backend, through
optimum-intel, in its own environment `.venv-peers`, `make install-peers`: optimum-intel wants an
older transformers than the project's), at OpenVINO's default precision (bf16 on a CPU that computes
it, f32 elsewhere), exported once before the rounds and saved as its docs advise, so that each timed
process loads the IR. Against it: `packed rerank` on `packed export --runtime openvino` folders, f32
and (on a bf16 CPU) bfloat16, exported once too. Every way runs once untimed first (OpenVINO's
compiled-shape cache and the page cache warm for all alike); each way's scores are compared with the
torch CrossEncoder's.
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


def cross_encoder_peer(model_folder: str, input_path: str, output_path: str, backend: str = "torch") -> None:
    """A peer, in its own process: CrossEncoder(backend=...).predict over every (query, text) pair
    (the OpenVINO backend in .venv-peers)."""
    from packed_transformers.common.telemetry import decline_openvino_telemetry

    decline_openvino_telemetry()  # before optimum-intel imports openvino: nothing leaves the machine
    from sentence_transformers import CrossEncoder

    queries = [json.loads(line) for line in open(input_path, encoding="utf-8") if line.strip()]
    pairs = [(q["query"], text) for q in queries for text in q["texts"]]
    scores = CrossEncoder(model_folder, device="cpu", backend=backend).predict(pairs, show_progress_bar=False)
    with open(output_path, "w", encoding="utf-8") as out:
        first = 0
        for i, q in enumerate(queries):
            own = [float(s) for s in scores[first : first + len(q["texts"])]]
            first += len(q["texts"])
            out.write(json.dumps({"index": i, "scores": own}) + "\n")


def export_openvino_peer(model_folder: str, output_folder: str) -> None:
    """Once, before the rounds (.venv-peers): the folder as sentence-transformers' OpenVINO backend
    exports it on first load, saved (its docs: save the exported model, load that)."""
    from packed_transformers.common.telemetry import decline_openvino_telemetry

    decline_openvino_telemetry()  # openvino.convert_model reports usage unless declined first
    from sentence_transformers import CrossEncoder

    CrossEncoder(model_folder, device="cpu", backend="openvino").save_pretrained(output_folder)


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
    parser.add_argument("--peers", choices=("openvino",), help="also the OpenVINO backend (module docstring)")
    parser.add_argument("--peer", nargs=3, metavar=("MODEL", "INPUT", "OUTPUT"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--openvino-peer", nargs=3, metavar=("MODEL", "INPUT", "OUTPUT"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--export-openvino-peer", nargs=2, metavar=("MODEL", "OUTPUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.peer:
        cross_encoder_peer(*args.peer)
        return 0
    if args.openvino_peer:
        cross_encoder_peer(*args.openvino_peer, backend="openvino")
        return 0
    if args.export_openvino_peer:
        export_openvino_peer(*args.export_openvino_peer)
        return 0
    peer_python = REPO / ".venv-peers" / "bin" / "python"
    if args.peers and not peer_python.exists():
        raise SystemExit(f"--peers openvino runs in {peer_python.parent.parent}: make install-peers")
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
        outputs = {"cross_encoder": scratch / "peer.jsonl", "packed_rerank": scratch / "packed.jsonl"}
        if args.peers:
            from packed_transformers.inference.precision import native_bf16

            peer_ir = scratch / "peer_openvino"
            timed([str(peer_python), __file__, "--export-openvino-peer", str(folder), str(peer_ir)], env)
            ways["cross_encoder_openvino"] = [str(peer_python), __file__, "--openvino-peer", str(peer_ir),
                                              str(queries), str(scratch / "peer_openvino.jsonl")]  # fmt: skip
            outputs["cross_encoder_openvino"] = scratch / "peer_openvino.jsonl"
            for dtype in ("float32", "bfloat16") if native_bf16("cpu") else ("float32",):
                exported = scratch / f"exported_openvino_{dtype}"
                timed([sys.executable, "-m", "packed_transformers", "export", "--model", str(folder), "--output",
                       str(exported), "--runtime", "openvino", "--dtype", dtype], env)  # fmt: skip
                name = f"packed_rerank_openvino_{dtype}"
                ways[name] = [sys.executable, "-m", "packed_transformers", "rerank", "--model", str(exported), "--input",
                              str(queries), "--output", str(scratch / f"{name}.jsonl"), "--overwrite"]  # fmt: skip
                outputs[name] = scratch / f"{name}.jsonl"
            for argv in ways.values():  # untimed: compiled-shape caches and the page cache warm for every way
                timed(argv, env)
        seconds = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in list(ways) if r % 2 == 0 else list(reversed(ways)):
                seconds[name].append(timed(ways[name], env))
        scores = {
            name: [json.loads(x)["scores"] for x in path.read_text().splitlines()]
            for name, path in outputs.items()
        }
    difference = {name: max(abs(a - b) for p, o in zip(scores["cross_encoder"], own) for a, b in zip(p, o))
                  for name, own in scores.items()}  # fmt: skip
    pairs = args.queries * args.candidates
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"\n# {args.queries} queries x {args.candidates} candidates ({pairs} pairs), {args.rounds} rounds, "
          f"{args.threads} threads, whole processes (medians)\n")  # fmt: skip
    print("| way | wall s | pairs/s | max score difference to CrossEncoder (torch f32) |")
    print("|---|---|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value:.2f} | {pairs / value:.1f} | {difference[name]:.2e} |")
    for ours, peer in (
        ("packed_rerank", "cross_encoder"),
        *((name, "cross_encoder_openvino") for name in seconds if name.startswith("packed_rerank_openvino")),
    ):
        ratios = [p / o for p, o in zip(seconds[peer], seconds[ours])]
        print(f"\n{ours} / {peer}: {statistics.median(ratios):.2f}x (paired median; "
              f"rounds {', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
