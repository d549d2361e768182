"""Inference in any batching mode, scoring and prediction files: what fine-tuning's
validation and `python -m packed_transformers.finetune.predict` share. Predictions come back in input order
(packs hold examples out of order; the example indices put them back)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from packed_transformers.common.files import atomic_path
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.inference.runner import per_sequence
from packed_transformers.packs.batching import Batcher

# numpy only: an exported folder's predict (door.exported_folder) scores without torch


def predict_logits(
    model, data, batcher: Batcher, device=None, dtype: str = "float32"
) -> tuple[np.ndarray, dict]:
    """Logits float32 [n, C] in input order, and timing/padding figures of the pass.
    `model` is a module (run on its own device) or a Runner (inference.runner, over any backend)."""
    if hasattr(model, "run") and hasattr(model, "stats"):
        runner = model
    else:
        from packed_transformers.inference.runner import Runner

        runner = Runner(model, device, dtype)
    tables = batcher.epoch(0, shuffle=False)
    start = time.perf_counter()
    batches = list(runner.run(data.token_ids, tables, batcher.width, data.segment_ids, ("logits",)))
    seconds = time.perf_counter() - start
    n = len(data)
    return per_sequence(batches, "logits", n), {
        "examples": n,
        "seconds": seconds,
        "examples_per_second": n / seconds,
        "batches": len(tables),
        "padding_fraction": batcher.padding_fraction(tables),
    }


def to_device(batch: dict, device) -> dict:
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}


def softmax(logits: np.ndarray) -> np.ndarray:
    """float32 softmax over the last axis (the largest logit subtracted first)."""
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return (shifted / shifted.sum(-1, keepdims=True)).astype(np.float32)


def example_losses(
    logits: np.ndarray, labels: np.ndarray, multi_label: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Per-example losses [n] (cross-entropy; multi-label: BCE with logits averaged over the
    C labels, as the training head's) and hits (per example: 0/1; multi-label: labels whose
    sign matches), computed in float64 from logits [n, C]."""
    x = logits.astype(np.float64)
    if multi_label:
        targets = labels.astype(np.float64)
        per_label = np.maximum(x, 0) - x * targets + np.log1p(np.exp(-np.abs(x)))
        return per_label.mean(-1), ((x > 0) == (targets > 0.5)).sum(-1)
    top = x.max(-1, keepdims=True)
    log_norm = (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[:, 0]
    return log_norm - x[np.arange(len(x)), labels], (x.argmax(-1) == labels).astype(np.int64)


def score(logits: np.ndarray, labels: np.ndarray, multi_label: bool) -> dict:
    """Loss, accuracy (multi-label: per label) and macro ROC-AUC of input-order logits [n, C]
    (ROC-AUC by scikit-learn: None where it is not installed, as in the light install)."""
    losses, hits = example_losses(logits, labels, multi_label)
    out = {
        "loss": float(losses.mean()),
        "accuracy": float(hits.sum()) / (hits.size * (logits.shape[1] if multi_label else 1)),
    }
    if multi_label:
        truth, scores = labels.astype(np.int64), 1 / (1 + np.exp(-logits))
    else:
        truth = np.eye(logits.shape[1], dtype=np.int64)[labels]
        scores = softmax(logits)
    # ROC-AUC needs both outcomes in a column; classes with one are left out and counted.
    usable = [c for c in range(truth.shape[1]) if 0 < truth[:, c].sum() < len(truth)]
    try:
        from sklearn.metrics import roc_auc_score
    except ImportError:
        usable = []
    out["roc_auc"] = (
        float(roc_auc_score(truth[:, usable], scores[:, usable], average="macro")) if usable else None
    )
    out["roc_auc_classes"] = len(usable)
    return out


def class_scores(logits: np.ndarray, multi_label: bool) -> np.ndarray:
    """[n, C] logits -> per-label sigmoids (multi-label, and a one-label model such as a
    cross-encoder, as transformers' text-classification pipeline scores them) or a softmax
    over the labels."""
    if multi_label or logits.shape[1] == 1:
        return 1 / (1 + np.exp(-logits))
    return softmax(logits)


def write_predictions(path: Path, logits: np.ndarray, label_names: list[str], multi_label: bool) -> None:
    """JSON lines in input order, written to a temporary name and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for record in prediction_records(logits, label_names, multi_label):
            f.write(json.dumps(record, allow_nan=False) + "\n")


def prediction_records(logits: np.ndarray, label_names: list[str], multi_label: bool, first_index: int = 0):
    """Logits [n, C] -> one dict per example: {"index", "label" (multi-label: "labels"),
    "scores": {label name: softmax (multi-label: sigmoid) score, 6 decimals, in class
    order}}, indices from first_index."""
    for i, row in enumerate(class_scores(logits, multi_label)):
        if not np.isfinite(row).all():  # never a label picked from NaN, never NaN in a JSON line
            raise ExampleError(
                f"example {first_index + i}: the model's scores are not finite ({row.tolist()[:4]}); "
                "its weights or the dtype overflow on this input"
            )
        record = {"index": first_index + i}
        if multi_label:
            record["labels"] = [label_names[c] for c in np.flatnonzero(row > 0.5)]
        else:
            record["label"] = label_names[int(row.argmax())]
        record["scores"] = {name: round(float(x), 6) for name, x in zip(label_names, row)}
        yield record
