"""`validate_batch`: the loader's debug-mode check of a packed batch. No cost when unused."""

from __future__ import annotations

import torch

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
    b, s = batch["input_ids"].shape
    for group in (FIELDS_S, FIELDS_M, FIELDS_K):
        shape = batch[group[0]].shape
        for name in group:
            if batch[name].shape != shape or shape[0] != b:
                raise BatchError(
                    f"field '{name}' has shape {tuple(batch[name].shape)}, expected "
                    f"{(b, shape[1])} like '{group[0]}'"
                )
    ids = batch["sequence_ids"].long()
    k = batch["next_sentence_positions"].shape[1]
    if vocab_size is not None and (batch["input_ids"].long() >= vocab_size).any():
        raise BatchError(f"input_ids hold a token id >= vocab_size {vocab_size}")
    if max_positions is not None and (batch["position_ids"].long() >= max_positions).any():
        raise BatchError(
            f"position_ids reach {int(batch['position_ids'].max())}, the model has {max_positions} positions"
        )
    for row in range(b):
        _validate_row(batch, row, ids[row], k, s)


def _validate_row(batch, row, ids, k, s):
    real = ids > 0
    n_real = int(real.sum())
    if not bool(real[:n_real].all()):
        raise BatchError(f"row {row}: padding (sequence_ids 0) must come after all real tokens")
    present = int(ids.max()) if n_real else 0
    if present > k:
        raise BatchError(f"row {row}: sequence id {present} exceeds K={k} slots")
    steps = ids[1:n_real] - ids[: n_real - 1]
    if n_real and (int(ids[0]) != 1 or bool(((steps != 0) & (steps != 1)).any())):
        raise BatchError(
            f"row {row}: sequence_ids must be contiguous runs 1, 2, ..., got {ids[:n_real].unique().tolist()}"
        )
    positions = batch["position_ids"][row].long()
    weights = batch["next_sentence_weights"][row]
    cls = batch["next_sentence_positions"][row].long()
    for j in range(1, k + 1):
        if j <= present:
            start = int(torch.nonzero(ids == j)[0])
            if int(weights[j - 1]) != 1 or int(cls[j - 1]) != start:
                raise BatchError(
                    f"row {row}: sequence {j} starts at {start}, but next_sentence_positions "
                    f"says {int(cls[j - 1])} (weight {int(weights[j - 1])})"
                )
            length = int((ids == j).sum())
            if not torch.equal(positions[start : start + length], torch.arange(length)):
                raise BatchError(f"row {row}: position_ids of sequence {j} must run 0..{length - 1}")
        elif int(weights[j - 1]) != 0:
            raise BatchError(f"row {row}: slot {j} has next_sentence_weights 1 but no tokens")
    mlm_weights = batch["masked_lm_weights"][row].long()
    mlm_positions = batch["masked_lm_positions"][row].long()
    used = mlm_weights > 0
    if used.any():
        if int(mlm_positions[used].max()) >= s:
            raise BatchError(f"row {row}: masked_lm_positions beyond S={s}")
        owner = ids[mlm_positions[used]]
        if not torch.equal(owner, mlm_weights[used]):
            bad = int(torch.nonzero(owner != mlm_weights[used])[0])
            raise BatchError(
                f"row {row}: masked token {bad} at position {int(mlm_positions[used][bad])} "
                f"is on sequence {int(owner[bad])} (0 = padding), but masked_lm_weights says "
                f"{int(mlm_weights[used][bad])}"
            )
