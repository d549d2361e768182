"""`python -m packed_transformers.training.summary --packed RUN [--unpacked RUN] [--plot PNG]`: a run, or packed vs unpacked.

Reads each run's metrics.jsonl and config.yaml (and the data's metadata.json) and prints
the packing factor, training throughput in real sequences and tokens per second (the
logging windows after the first, to leave out start-up; evaluation time is not training
time), with --unpacked the realized speed-up, the eval MLM accuracy at the end and at the unpacked run's
end time, and the unigram baseline (always predicting the most frequent masked token).
--plot draws eval MLM accuracy against training seconds and against sequences seen.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from packed_transformers.common.cli import command_parser, refuse
from packed_transformers.components.curves import (
    MetricsFileError,
    curve_from_records,
    plot_curves,
    read_records,
    unigram_baseline,
)


def run_figures(run: Path) -> dict:
    config = yaml.safe_load((run / "config.yaml").read_text())
    meta = json.loads((Path(config["data"]["train_dir"]) / "metadata.json").read_text())
    records = read_records(run)
    train, evals = records.get("train", []), records.get("eval", [])
    # Windows whose every step was skipped (non-finite) report no figures: not part of speed.
    trained = [r for r in train if r.get("loss") is not None and r.get("sequences_per_second")]
    steady = trained[1:] or trained
    seconds = sum(r["sequences"] / r["sequences_per_second"] for r in steady)
    tokens = sum(r["tokens_per_second"] * r["sequences"] / r["sequences_per_second"] for r in steady)
    # The run's end: its "end" record (written when the run stops, also between logging
    # windows, e.g. at a time limit); a run killed before writing one ends at its last window.
    end = records.get("end", [])[-1:] or train[-1:] or [{"step": 0, "samples": 0, "train_seconds": 0.0}]
    end = end[0] if not train or end[0]["step"] >= train[-1]["step"] else train[-1]
    return {
        "run": str(run),
        "config": config,
        "packing_factor": meta["packing_factor"],
        "steps": end["step"],
        "sequences": end["samples"],
        "train_seconds": end["train_seconds"],
        "sequences_per_second": sum(r["sequences"] for r in steady) / seconds if seconds else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "final_train_loss": trained[-1]["loss"] if trained else None,
        "stopped_by": end.get("stopped_by", end.get("status", "-")),
        "eval_mlm_accuracy": evals[-1]["mlm_accuracy"] if evals else None,
        "curve": curve_from_records(evals),
    }


def accuracy_at(curve: dict, seconds: float) -> float | None:
    """Eval MLM accuracy of the last evaluation at or before `seconds` of training."""
    before = np.flatnonzero(curve["train_seconds"] <= seconds + 1e-9)
    return float(curve["mlm_accuracy"][before[-1]]) if before.size else None


def print_single(figures: dict, plot: Path | None) -> int:
    """One run's table row, its unigram baseline and (optionally) its learning curve."""
    print(
        "| run | packing factor | steps | stopped by | sequences | training s | sequences/s | real tokens/s | train loss "
        "| eval MLM acc |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    acc = "-" if figures["eval_mlm_accuracy"] is None else f"{figures['eval_mlm_accuracy']:.4f}"
    loss = "-" if figures["final_train_loss"] is None else f"{figures['final_train_loss']:.3f}"
    print(
        f"| {figures['run']} | {figures['packing_factor']:.3f} | {figures['steps']} | {figures['stopped_by']} "
        f"| {figures['sequences']} | "
        f"{figures['train_seconds']:.0f} | {figures['sequences_per_second']:.1f} | {figures['tokens_per_second']:.0f} "
        f"| {loss} | {acc} |"
    )
    data, baseline = figures["config"]["data"], None
    if data["eval_dir"]:
        token, baseline = unigram_baseline(
            data["train_dir"], data["eval_dir"], figures["config"]["eval"]["max_sequences"]
        )
        print(f"unigram baseline (always predict token id {token}): eval MLM accuracy {baseline:.4f}")
    if plot:
        title = f"{figures['config']['model']['preset']}, S={data['max_sequence_length']}"
        plot_curves({"run": [figures["curve"]]}, baseline, plot, title)
        print(f"wrote {plot}")
    return 0


def main(argv=None) -> int:
    parser = command_parser("python -m packed_transformers.training.summary", __doc__)
    parser.add_argument(
        "--packed", required=True, type=Path, help="run folder (run_pretraining.py --output-dir)"
    )
    parser.add_argument("--unpacked", type=Path, help="the unpacked baseline's run folder, to compare with")
    parser.add_argument("--plot", type=Path, help="write the learning curves here (PNG)")
    args = parser.parse_args(argv)
    try:
        packed = run_figures(args.packed)
        unpacked = None if args.unpacked is None else run_figures(args.unpacked)
    except (MetricsFileError, OSError, KeyError, TypeError, yaml.YAMLError, json.JSONDecodeError) as err:
        # A missing, cut-off or foreign run folder: one line, not a traceback.
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        where = f"{err.filename}: " if isinstance(err, OSError) and err.filename else ""
        return refuse(f"{where}{reason} (expected a run_pretraining.py output folder)")
    if unpacked is None:
        return print_single(packed, args.plot)
    print(
        "| run | packing factor | steps | sequences | training s | sequences/s | real tokens/s "
        "| train loss | eval MLM acc |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, f in (("unpacked", unpacked), ("packed", packed)):
        acc = "-" if f["eval_mlm_accuracy"] is None else f"{f['eval_mlm_accuracy']:.4f}"
        loss = "-" if f["final_train_loss"] is None else f"{f['final_train_loss']:.3f}"
        print(
            f"| {name} | {f['packing_factor']:.3f} | {f['steps']} | {f['sequences']} | {f['train_seconds']:.0f} | "
            f"{f['sequences_per_second']:.1f} | {f['tokens_per_second']:.0f} | {loss} | {acc} |"
        )
    if not unpacked["sequences_per_second"]:
        return refuse(f"{args.unpacked}: no trained logging window to compare with")
    speedup = packed["sequences_per_second"] / unpacked["sequences_per_second"]
    print(
        f"\nrealized speed-up {speedup:.3f} (sequences/s packed / unpacked) = "
        f"{speedup / packed['packing_factor']:.3f} x packing factor {packed['packing_factor']:.3f}"
    )
    eval_config = unpacked["config"]["eval"]
    data = unpacked["config"]["data"]
    baseline = None
    if data["eval_dir"]:
        token, baseline = unigram_baseline(data["train_dir"], data["eval_dir"], eval_config["max_sequences"])
        print(f"unigram baseline (always predict token id {token}): eval MLM accuracy {baseline:.4f}")
    lines = comparison(packed, unpacked, baseline)
    if args.plot:
        series = {"unpacked": [unpacked["curve"]], "packed": [packed["curve"]]}
        title = (
            f"{unpacked['config']['model']['preset']}, S={data['max_sequence_length']}: packed "
            f"(packing factor {packed['packing_factor']:.2f}) vs unpacked"
        )
        plot_curves(series, baseline, args.plot, title)
        print(f"wrote {args.plot}")
    print("\n".join(lines))  # the verdict last: what the two runs show, or that they show nothing
    return 0


def comparison(packed: dict, unpacked: dict, baseline: float | None) -> list[str]:
    """The packed and unpacked runs compared at equal sequences (their ends, when they
    trained the same number) and at equal training time (the shorter run's end, read off
    both curves). The last line is the verdict: what the runs show, or, where either run
    never evaluated or never passed the unigram baseline, that they show nothing yet
    and what to run instead."""
    lines = []
    p_acc, u_acc = packed["eval_mlm_accuracy"], unpacked["eval_mlm_accuracy"]
    same_sequences = abs(packed["sequences"] - unpacked["sequences"]) <= 0.05 * max(unpacked["sequences"], 1)
    if same_sequences and p_acc is not None and u_acc is not None:
        lines.append(
            f"at equal sequences ({unpacked['sequences']:,}): packed {packed['train_seconds']:.0f} s vs unpacked "
            f"{unpacked['train_seconds']:.0f} s of training; eval MLM accuracy packed {p_acc:.4f} vs unpacked {u_acc:.4f}"
        )
    seconds = min(packed["train_seconds"], unpacked["train_seconds"])
    p_then, u_then = accuracy_at(packed["curve"], seconds), accuracy_at(unpacked["curve"], seconds)
    if p_then is not None and u_then is not None:
        lines.append(
            f"at equal training time ({seconds:.0f} s): eval MLM accuracy packed {p_then:.4f} vs unpacked {u_then:.4f}"
        )
    weak = [name for name, acc in (("packed", p_acc), ("unpacked", u_acc))
            if acc is None or (baseline is not None and acc <= baseline)]  # fmt: skip
    if weak:
        why = "never evaluated" if any(a is None for a in (p_acc, u_acc)) else (
            f"did not pass the unigram baseline ({baseline:.4f})")  # fmt: skip
        lines.append(
            f"inconclusive: the {' and '.join(weak)} run {why}, so these runs show nothing about packing's effect "
            f"on learning; train longer (raise training.max_train_seconds; the demo in a clone: make demo "
            f"DEMO_SEQUENCES={2 * max(unpacked['sequences'], 1):,})"
        )
        return lines
    speedup = unpacked["train_seconds"] / max(packed["train_seconds"], 1e-9)
    if same_sequences:
        lines.append(
            f"verdict: packed trained the same {unpacked['sequences']:,} sequences in {packed['train_seconds']:.0f} s, "
            f"unpacked in {unpacked['train_seconds']:.0f} s ({speedup:.2f}x), to eval MLM accuracy {p_acc:.4f} vs "
            f"{u_acc:.4f} (unigram baseline {baseline:.4f})"
            if baseline is not None
            else f"verdict: packed trained the same {unpacked['sequences']:,} sequences {speedup:.2f}x as fast"
        )
    else:
        lines.append(
            f"verdict: in {seconds:.0f} s of training, packed reached eval MLM accuracy {p_then:.4f} and unpacked "
            f"{u_then:.4f}; they trained different numbers of sequences"
        )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
