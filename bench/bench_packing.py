"""Packing benchmark: efficiency and solve time of every algorithm on the published
histograms, beside the published figures (Krell et al. 2021; docs/packing.md, measured).

    python bench/bench_packing.py            # prints a markdown table

All rows are measured in one run on this machine; times are wall-clock seconds of
the solve only (reading the histogram excluded), best of `--repeats`.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packed_transformers.packing import Histogram, pack  # noqa: E402

HISTOGRAMS = Path(__file__).resolve().parent.parent / "packed_transformers" / "packing" / "histograms"

# (histogram, algorithm, K, published efficiency or None, published seconds or None, goal)
CASES = [
    ("wikipedia_512", "none", 1, 0.4997, None, ""),
    *[
        ("wikipedia_512", "spfhp", k, e, 0.03, "< 0.1 s")
        for k, e in [(2, 0.8052), (3, 0.8944), (4, 0.9394), (8, 0.9890), (12, 0.9960)]
    ],
    *[
        ("wikipedia_512", "lpfhp", k, e, 0.05, "< 0.1 s")
        for k, e in [(2, 0.8055), (3, 0.8949), (4, 0.9396), (8, 0.9911), (12, 0.9981)]
    ],
    ("wikipedia_512", "lpfhp", None, None, None, "< 0.1 s"),
    ("wikipedia_512", "nnlshp", 3, 0.99750, 24.3, "< 10 s"),
    ("wikipedia_512", "lp", 2, None, None, "bound 0.80546"),
    ("wikipedia_512", "lp", 3, None, None, ">= 0.99874, < 5 s"),
    ("wikipedia_512", "lp", 4, None, None, "bound 0.99983"),
    ("wikipedia_512", "lp", None, None, None, ">= 0.99973, < 5 s"),
    ("wikipedia_512", "bfd", 3, None, None, "baseline"),
    ("wikipedia_512", "greedy", 3, None, None, "baseline"),
    ("squad_384", "spfhp", 3, 0.9755, None, ""),
    ("squad_384", "lpfhp", 3, 0.9774, None, ""),
    ("squad_384", "nnlshp", 3, 0.9739, None, ""),
    ("squad_384", "lp", 3, None, None, ">= 0.98791, < 5 s"),
    ("squad_384", "lp", None, None, None, ">= 0.98791, < 5 s"),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeats", type=int, default=3)
    algorithms = sorted({c[1] for c in CASES})
    parser.add_argument(
        "--algorithms", nargs="+", default=algorithms, choices=algorithms, help="the rows to run"
    )
    args = parser.parse_args()
    histograms = {
        name: Histogram.from_json_file(HISTOGRAMS / f"{name}.json") for name in {c[0] for c in CASES}
    }
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print("| histogram | algorithm | K | efficiency | published | LP bound | seconds | published s | goal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, algorithm, k, published, published_s, goal in CASES:
        if algorithm not in args.algorithms:
            continue
        repeats = 1 if algorithm == "greedy" else args.repeats
        plans = [pack(histograms[name], algorithm, k) for _ in range(repeats)]
        plan = min(plans, key=lambda p: p.seconds)
        bound = plan.extra.get("lp_bound_efficiency")
        print(
            f"| {name} | {algorithm} | {'max' if k is None else k} | {plan.efficiency:.5f} | "
            f"{'' if published is None else f'{published:.5f}'} | "
            f"{'' if bound is None else f'{bound:.5f}'} | {plan.seconds:.3f} | "
            f"{'' if published_s is None else published_s} | {goal} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
