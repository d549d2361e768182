"""Pack and verify throughput and peak memory on synthetic Wikipedia-length shards.

    python bench/bench_pipeline.py [--sizes 1000000 4000000] [--workers 2] [--folder /tmp/packbench]

Generates unpacked shards (S=512, P=76, lengths drawn from the published Wikipedia-512
histogram, 2^18 rows per file), then runs `python -m packed_transformers.packing pack` and `verify` as a
user would, sampling the summed PSS of the command and its worker processes every 100 ms.
Prints a markdown table. Needs about 2.4 KB of disk per sequence for the inputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from packed_transformers.common.constants import BERT_VOCAB_SIZE  # noqa: E402
from packed_transformers.data.synthetic import write_synthetic_shards  # noqa: E402


def run_measured(cmd: list[str]) -> tuple[float, float, str]:
    """(seconds, peak memory in GiB, stdout) of a command and its worker processes.

    Memory is the summed PSS (proportional set size): forked workers share the parent's
    pages copy-on-write, and summing plain RSS would count those pages once per process."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    parent = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            procs = [parent, *parent.children(recursive=True)]
            rss = sum(p.memory_full_info().pss for p in procs)
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.1)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return time.perf_counter() - started, peak / 2**30, out


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--algorithm", default="lpfhp")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/packbench"))
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    args = parser.parse_args()
    counts = np.array(
        json.loads((REPO / "packed_transformers/packing/histograms/wikipedia_512.json").read_text())["counts"]
    )
    rows = []
    for n in args.sizes:
        folder = args.folder / f"n{n}"
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        write_synthetic_shards(folder / "in", counts, n, rows_per_file=1 << 18, seed=1)
        generate = time.perf_counter() - t0
        py = sys.executable
        pack_s, pack_gib, pack_out = run_measured(
            [
                py,
                "-m",
                "packed_transformers.packing",
                "pack",
                "--input",
                f"{folder}/in/*.h5",
                "--output",
                f"{folder}/packed",
                "--algorithm",
                args.algorithm,
                "--max-sequences-per-pack",
                "3",
                "--workers",
                str(args.workers),
                "--vocab-size",
                str(BERT_VOCAB_SIZE),
                "--quiet",
            ]
        )
        verify_s, verify_gib, verify_out = run_measured(
            [
                py,
                "-m",
                "packed_transformers.packing",
                "verify",
                "--input",
                f"{folder}/in/*.h5",
                "--packed",
                f"{folder}/packed",
                "--workers",
                str(args.workers),
                "--quiet",
            ]
        )
        summary = json.loads(pack_out.splitlines()[-1])
        report = json.loads(verify_out.splitlines()[0])
        assert report["ok"], verify_out
        input_gb = sum(p.stat().st_size for p in (folder / "in").glob("*.h5")) / 1e9
        rows.append(
            (
                n,
                input_gb,
                summary["packing_factor"],
                pack_s,
                n / pack_s,
                pack_gib,
                verify_s,
                n / verify_s,
                verify_gib,
                generate,
            )
        )
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{args.algorithm}, K=3, S=512, {args.workers} workers\n")
    print(
        "| sequences | input GB | packing factor | pack s | pack seq/s | pack peak PSS GiB | verify s | verify seq/s | verify peak PSS GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, gb, pf, ps, prate, pgib, vs, vrate, vgib, _ in rows:
        print(
            f"| {n:,} | {gb:.2f} | {pf:.3f} | {ps:.1f} | {prate:,.0f} | {pgib:.2f} | {vs:.1f} | {vrate:,.0f} | {vgib:.2f} |"
        )


if __name__ == "__main__":
    main()
