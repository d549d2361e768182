"""`validate_batch`: the debug option's check of a packed batch as tensors
(`data.validate_batches`). No cost when unused.

What is particular to tensors (fields present, integer dtypes, 2-D, matching widths) and
to the model (positions below its position embeddings) is checked here; the packed
format's row rules are packs.structure's `first_malformed`, the check the training
reader runs on every batch, stated once.
"""

from __future__ import annotations

import torch

from packed_transformers.packs.structure import first_malformed

FIELDS_S = ("input_ids", "segment_ids", "position_ids", "sequence_ids")
FIELDS_M = ("masked_lm_positions", "masked_lm_ids", "masked_lm_weights")
FIELDS_K = ("next_sentence_positions", "next_sentence_labels", "next_sentence_weights")


class BatchError(ValueError):
    """A packed batch that breaks the format; the message says what was expected."""


def validate_batch(batch: dict, vocab_size: int | None = None, max_positions: int | None = None) -> None:
    """Raise BatchError unless `batch` is a well-formed packed batch (ARCHITECTURE.md section 3)."""
    for name in FIELDS_S + FIELDS_M + FIELDS_K:
        if name not in batch:
            raise BatchError(f"batch has no field '{name}'")
        t = batch[name]
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise BatchError(
                f"field '{name}' must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}"
            )
        if t.ndim != 2:
            raise BatchError(f"field '{name}' must be 2-D [packs, width], got shape {tuple(t.shape)}")
    b = batch["input_ids"].shape[0]
    for group in (FIELDS_S, FIELDS_M, FIELDS_K):
        shape = batch[group[0]].shape
        for name in group:
            if batch[name].shape != shape or shape[0] != b:
                raise BatchError(
                    f"field '{name}' has shape {tuple(batch[name].shape)}, expected "
                    f"{(b, shape[1])} like '{group[0]}'"
                )
    if max_positions is not None and (batch["position_ids"].long() >= max_positions).any():
        raise BatchError(
            f"position_ids reach {int(batch['position_ids'].max())}, the model has {max_positions} positions"
        )
    fields = {name: batch[name].cpu().numpy() for name in FIELDS_S + FIELDS_M + FIELDS_K}
    malformed = first_malformed(fields, vocab_size)
    if malformed is not None:
        row, what = malformed
        raise BatchError(f"row {row}: {what}")
