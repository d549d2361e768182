"""The packing report: one plan as JSON, or a table of algorithms x depths (the paper's Table 1)."""

from __future__ import annotations

from packed_transformers.packs.algorithms import ALGORITHMS, pack
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import PackingPlan

TABLE_DEPTHS = (1, 2, 3, 4, 8, None)
NNLSHP_MAX_DEPTH = 3


def report_table(histogram: Histogram, algorithms=tuple(ALGORITHMS), depths=TABLE_DEPTHS) -> str:
    """Efficiency and solve seconds of every algorithm at every depth, as aligned text."""
    header = ["algorithm"] + [f"K={'max' if k is None else k}" for k in depths]
    rows = []
    for algorithm in algorithms:
        cells = [algorithm]
        for k in depths:
            if algorithm == "nnlshp" and (k is None or k > NNLSHP_MAX_DEPTH):
                cells.append("-")
                continue
            plan = pack(histogram, algorithm, k)
            cells.append(f"{plan.efficiency:.5f} ({plan.seconds:.2f}s)")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [
        f"N={histogram.max_sequence_length}  sequences={histogram.sequences:,}  "
        f"padding unpacked={histogram.padding_fraction_unpacked:.4f}  "
        f"theoretical speed-up={histogram.theoretical_speedup:.4f}",
        "efficiency = real tokens / packed tokens (solve seconds)",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def describe_plan(plan: PackingPlan) -> str:
    s = plan.summary()
    lines = [f"{key:>22}: {value}" for key, value in s.items()]
    if "lp_bound_efficiency" in plan.extra:
        lines.append(f"{'lp_bound_efficiency':>22}: {plan.extra['lp_bound_efficiency']:.6f}")
    return "\n".join(lines)


def plot_plan(histogram: Histogram, plan: PackingPlan, path) -> None:
    """Two panels: the sequence-length histogram and the histogram of tokens per pack."""
    plot_plans(histogram, {plan.algorithm: plan}, path)


def plot_plans(histogram: Histogram, plans: dict, path) -> None:
    """Two panels: the sequence-length histogram, and the tokens per pack of every plan
    ({label: PackingPlan} of the same sequences, e.g. the unpacked baseline and the packed
    set), drawn over each other (log scale: full packs and the padding tail both show)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from packed_transformers.common.files import atomic_path

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.bar(histogram.lengths, histogram.counts, width=1.0)
    left.set(
        title=f"sequence lengths ({histogram.sequences:,} sequences)", xlabel="tokens", ylabel="sequences"
    )
    for (label, plan), color in zip(plans.items(), ("tab:green", "tab:orange", "tab:blue", "tab:red")):
        fill = np.zeros(plan.max_sequence_length, dtype=np.int64)
        for strategy, count in zip(plan.strategies, plan.counts.tolist()):
            fill[sum(strategy) - 1] += count
        right.step(histogram.lengths, fill, where="mid", color=color,
                   label=f"{label}: {plan.algorithm}, {int(plan.counts.sum()):,} packs, efficiency {plan.efficiency:.3f}")  # fmt: skip
    right.set(title="real tokens per pack (row)", xlabel="real tokens in pack", ylabel="packs")
    right.set_yscale("log")
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def datasets_table(metadatas: dict) -> str:
    """Before/after table of packed datasets: {label: metadata.json dict} -> markdown."""
    lines = [
        "| dataset | algorithm | K | sequences | packs | padding fraction | packing factor | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, meta in metadatas.items():
        padding = 1.0 - meta["real_tokens"] / (meta["packs"] * meta["S"])
        lines.append(
            f"| {label} | {meta['algorithm']} | {meta['K']} | {meta['sequences']:,} | {meta['packs']:,} | "
            f"{padding:.4f} | {meta['packing_factor']:.4f} | {meta['efficiency']:.4f} |"
        )
    return "\n".join(lines)
