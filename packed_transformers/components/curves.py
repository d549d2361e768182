"""Learning curves of finished runs: their metrics.jsonl, the unigram baseline, plots.

Used by `training.summary` (the demo's packed vs unpacked table and plot) and by
`bench/bench_convergence.py` (the convergence study over seeds).

A run's curve is its eval records (kind "eval" in metrics.jsonl), each with the
sequences trained so far (`samples`) and the training time so far (`train_seconds`:
wall time less evaluations and checkpoints, training.run.Run.train_seconds).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from packed_transformers.packing.shards import PackedDataset


class MetricsFileError(ValueError):
    """metrics.jsonl cannot be read; the message names the file and line."""


def read_metric_lines(path: Path) -> list[str]:
    """The complete lines of a metrics.jsonl, each a JSON object. An unterminated last line
    (the run was killed, or the disk filled, mid-write) is dropped: it was never a whole
    record. Anything else unreadable raises MetricsFileError naming the file and line."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise MetricsFileError(f"{path}: not a metrics.jsonl (not UTF-8 text at byte {err.start})") from None
    lines = text.split("\n")
    complete, partial = lines[:-1], lines[-1]  # after the last newline: "" or a cut-off record
    del partial
    for number, line in enumerate(complete, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise MetricsFileError(f"{path}, line {number}: not a JSON record ({err.msg})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise MetricsFileError(f'{path}, line {number}: expected an object with a "kind"')
    return complete


def read_records(run: Path) -> dict[str, list[dict]]:
    """{kind: records in file order} of `run`/metrics.jsonl (kinds: train, eval, end)."""
    records: dict[str, list[dict]] = {}
    for line in read_metric_lines(Path(run) / "metrics.jsonl"):
        record = json.loads(line)
        records.setdefault(record["kind"], []).append(record)
    return records


def eval_curve(run: Path) -> dict[str, np.ndarray]:
    """The eval curve of `run`'s metrics.jsonl (curve_from_records)."""
    return curve_from_records(read_records(run).get("eval", []))


def curve_from_records(evals: list[dict]) -> dict[str, np.ndarray]:
    """float64 arrays of equal length, one entry per eval record: samples (sequences
    trained), train_seconds, mlm_accuracy, mlm_loss."""
    keys = ("samples", "train_seconds", "mlm_accuracy", "mlm_loss")
    return {key: np.array([float(r[key]) for r in evals]) for key in keys}


def masked_labels(dataset: PackedDataset, packs: list[int] | None = None) -> np.ndarray:
    """int64 [masked tokens]: the labels of every used masked-LM slot of `packs` (all packs
    when None), read in blocks."""
    from packed_transformers.components.data import PackedShards  # torch: imported only where data is read

    shards = PackedShards(dataset)
    packs = list(range(len(shards))) if packs is None else packs
    labels = []
    for start in range(0, len(packs), 4096):
        batch = shards[packs[start : start + 4096]]
        weights = batch["masked_lm_weights"].numpy()
        labels.append(batch["masked_lm_ids"].numpy()[weights > 0])
    return np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)


def unigram_baseline(train_dir, eval_dir, max_sequences: int) -> tuple[int, float]:
    """(token id, accuracy): the most frequent masked label of the training data and the
    MLM accuracy of always predicting it on the evaluation a run performs (the first
    packs holding at most `max_sequences` sequences, as components.data.eval_batches picks).
    A model has learned something beyond token frequencies only above this accuracy."""
    from packed_transformers.components.data import eval_batches
    from packed_transformers.packing.shards import PackedDataset

    train = masked_labels(PackedDataset.open(train_dir))
    most_frequent = int(np.bincount(train).argmax())
    eval_data = PackedDataset.open(eval_dir)
    _, batches, _ = eval_batches(eval_data, 1, max_sequences, rank=0, world=1)
    labels = masked_labels(eval_data, [p for batch in batches for p in batch])
    return most_frequent, float((labels == most_frequent).mean()) if labels.size else 0.0


def plot_curves(
    series: dict[str, list[dict[str, np.ndarray]]],
    baseline: float | None,
    path: Path,
    title: str,
    metrics: tuple[str, ...] = ("mlm_accuracy",),
):
    """One row per metric (eval MLM accuracy, loss): against training seconds (left) and
    sequences trained (right).

    series: {label: [curve per seed]} (eval_curve dicts). One seed: its line; several:
    the mean over seeds at each evaluation (the k-th evaluations of a variant's seeds
    happen within one step of each other) with a band of +- one standard deviation, drawn
    against sequences; against seconds, the mean line. The unigram baseline is drawn on
    the accuracy row. Written to `path` (PNG) by atomic rename."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from packed_transformers.common.files import atomic_path

    labels = {"mlm_accuracy": "eval MLM accuracy", "mlm_loss": "eval MLM loss"}
    fig, axes = plt.subplots(len(metrics), 2, figsize=(11, 4.2 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
        by_time, by_sequences = axes[row]
        for label, curves in series.items():
            points = min(len(c["samples"]) for c in curves)
            samples = np.stack([c["samples"][:points] for c in curves]).mean(0)
            seconds = np.stack([c["train_seconds"][:points] for c in curves]).mean(0)
            values = np.stack([c[metric][:points] for c in curves])
            mean = values.mean(0)
            name = label if len(curves) == 1 else f"{label} (mean of {len(curves)} seeds)"
            (line,) = by_sequences.plot(samples, mean, marker="o", ms=3, label=name)
            if len(curves) > 1:
                sd = values.std(0, ddof=1)
                by_sequences.fill_between(samples, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
            by_time.plot(seconds, mean, marker="o", ms=3, color=line.get_color())
        for axis, xlabel in (
            (by_time, "training seconds (evaluation not counted)"),
            (by_sequences, "sequences seen"),
        ):
            if baseline is not None and metric == "mlm_accuracy":
                axis.axhline(baseline, color="grey", ls="--", lw=1, label="unigram baseline")
            axis.set_xlabel(xlabel)
            axis.set_ylabel(labels.get(metric, metric))
            axis.grid(alpha=0.3)
        by_sequences.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
