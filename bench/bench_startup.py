"""Start-up of the torch-free process (issue 93, deliverable 4): `packed embed` on an exported
int8 folder against the 40-line torch-free ONNX Runtime int8 script, both embedding a few texts
as whole processes, and where the exported process's start-up goes (`-X importtime`).

    python bench/bench_startup.py [--texts 10] [--rounds 7] [--threads 2]

Both graphs are made once before the rounds (not timed): ours by `packed export --dtype int8`,
the script's as its users make it (bench_int8.onnx_int8_graphs: the exported encoder through
ONNX Runtime's transformer optimizer, then quantize_dynamic). Rounds alternate the two; the
median wall time of each and their difference are printed, then the exported process's
imports by cumulative time (the ten largest top-level packages).
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


def wall(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed: {done.stderr[-2000:]}")
    return seconds


def import_times(argv: list[str], env: dict) -> list[tuple[str, float]]:
    """-X importtime of the process: (top-level package, cumulative seconds), largest first."""
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=REPO, env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    totals: dict[str, float] = {}
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = (part.strip() for part in line.split(":", 1)[1].split("|"))
        if cumulative.isdigit() and not name.startswith(" ") and "." not in name.strip():
            totals[name.strip()] = totals.get(name.strip(), 0.0) + int(cumulative) / 1e6
    return sorted(totals.items(), key=lambda item: -item[1])[:10]


def main() -> int:
    from bench_embed import PEER_SCRIPT
    from bench_int8 import onnx_int8_graphs
    from bench_onnx import export_onnx

    from packed_transformers.data.assets import corpus_glob, model_dir
    from packed_transformers.data.embedding_texts import bbc_articles, texts_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        ORT_DISABLE_TELEMETRY="1",
    )
    texts = texts_of(bbc_articles(corpus_glob()), "mixed")[: args.texts]
    model = model_dir()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        source = scratch / "texts.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        subprocess.run([sys.executable, "-m", "packed_transformers.commands.export", "--model", str(model),
                        "--output", str(scratch / "ours"), "--dtype", "int8"], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        export_onnx(model, scratch / "minilm.onnx")
        _, peer_graph = onnx_int8_graphs(scratch / "minilm.onnx", model)
        ways = {
            "packed embed (exported int8)": [sys.executable, "-m", "packed_transformers.commands.embed", "--model",
                                             str(scratch / "ours"), "--input", str(source), "--output",
                                             str(scratch / "ours.npy"), "--quiet", "--overwrite"],
            "torch-free ONNX Runtime int8 script": [sys.executable, "-c", PEER_SCRIPT, str(peer_graph), str(source),
                                                    str(scratch / "peer.npy"), str(args.threads), "onnxruntime-int8",
                                                    str(REPO / "bench"), str(model)],
        }  # fmt: skip
        for argv in ways.values():  # warm the page cache once
            wall(argv, env)
        times = {name: [] for name in ways}
        for round_ in range(args.rounds):
            for name in list(ways)[round_ % 2 :] + list(ways)[: round_ % 2]:
                times[name].append(wall(ways[name], env))
        imports = import_times(ways["packed embed (exported int8)"], env)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"# {args.texts} texts, {args.threads} threads, {args.rounds} rounds alternating; whole process, seconds"
    )
    print("| process | median | range |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {medians[name]:.3f} | {min(values):.3f}-{max(values):.3f} |")
    ours, peer = medians.values()
    print(f"\nexported - script: {ours - peer:+.3f} s (goal: within 0.3 s)")
    print("\nthe exported process's imports, cumulative seconds (-X importtime, one run):")
    for name, seconds in imports:
        print(f"  {name:24s} {seconds:.3f}")
    if args.json:
        from bench.machine import description

        args.json.write_text(json.dumps({"command": "python bench/bench_startup.py " + " ".join(sys.argv[1:]),
                                         "machine": description(), "times": times, "imports": imports}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
