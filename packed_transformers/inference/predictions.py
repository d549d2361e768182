"""Inference in any batching mode, scoring and prediction files: what fine-tuning's
validation and `python -m packed_transformers.finetune.predict` share. Predictions come back in input order
(packs hold examples out of order; the example indices put them back)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from packed_transformers.common.files import atomic_path
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.inference.batching import Batcher
from packed_transformers.inference.runner import Runner, per_sequence
from packed_transformers.model.task_heads import classification_metrics


def predict_logits(
    model, data, batcher: Batcher, device=None, dtype: str = "float32"
) -> tuple[np.ndarray, dict]:
    """Logits float32 [n, C] in input order, and timing/padding figures of the pass.
    `model` is a module (run on its own device) or a inference.runner.Runner."""
    runner = model if isinstance(model, Runner) else Runner(model, device, dtype)
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


def to_device(batch: dict, device: torch.device) -> dict:
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}


def score(logits: np.ndarray, labels: np.ndarray, multi_label: bool) -> dict:
    """Loss, accuracy (multi-label: per label) and macro ROC-AUC of input-order logits [n, C]."""
    from sklearn.metrics import roc_auc_score

    logits_t = torch.from_numpy(logits)[:, None]
    labels_t = torch.from_numpy(labels)[:, None]
    present = torch.ones(logits_t.shape[:2], dtype=torch.bool)
    metrics = classification_metrics(logits_t, labels_t, present, multi_label)
    out = {
        "loss": float(metrics["loss_sum"] / metrics["count"]),
        "accuracy": float(metrics["correct"]) / float(metrics["correct_count"]),
    }
    if multi_label:
        truth, scores = labels.astype(np.int64), 1 / (1 + np.exp(-logits))
    else:
        truth = np.eye(logits.shape[1], dtype=np.int64)[labels]
        scores = torch.softmax(torch.from_numpy(logits), -1).numpy()
    # ROC-AUC needs both outcomes in a column; classes with one are left out and counted.
    usable = [c for c in range(truth.shape[1]) if 0 < truth[:, c].sum() < len(truth)]
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
    return torch.softmax(torch.from_numpy(logits), -1).numpy()


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
