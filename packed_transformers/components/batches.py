"""A fine-tuning step's micro-batch: a batch table (packs.batching.Batcher, shared with inference)
made into the model's rows and the labels of its slots, as torch tensors on the host.

Kept in training's room (inference plans and packs the same tables but never needs labels)."""

from __future__ import annotations

import numpy as np
import torch

from packed_transformers.packs.rows import pack_rows


def collate(data, table: np.ndarray, width: int, with_labels: bool = True) -> dict:
    """Model inputs for one batch table: pack_rows' fields [rows, width] / [rows, K] and labels
    [rows, K] (or [rows, K, C] multi-label, [rows, K, 2] span positions; zeros in empty slots)."""
    rows = pack_rows(data.token_ids, table, width, data.segment_ids)
    batch = {name: torch.from_numpy(value) for name, value in rows.items()}
    if with_labels:
        labels = data.labels[np.maximum(table, 0)]
        labels[table < 0] = 0
        # multi-hot labels (uint8) are BCE targets; class ids and span positions are int64
        batch["labels"] = torch.from_numpy(
            labels.astype(np.float32 if labels.dtype == np.uint8 else np.int64)
        )
    return batch
