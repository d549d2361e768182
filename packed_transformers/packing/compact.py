"""Compact sequences: real tokens only, back to back, with offsets (no padding).

The pack pipeline's intermediate form. A `SequenceStore` holds n sequences:
  tokens, segments          [T]     flat real tokens (T = sum of lengths)
  lengths                   [n]     tokens per sequence
  mlm_positions, mlm_ids    [Q]     flat used masked-LM slots, positions relative to the sequence
  predictions               [n]     used slots per sequence
  next_sentence_labels      [n]
  source_index              [n]     global index of the sequence (inputs in order, rows in order)
Offsets into the flat arrays are cumulative sums of lengths / predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np


@dataclass
class SequenceStore:
    tokens: np.ndarray
    segments: np.ndarray
    lengths: np.ndarray
    mlm_positions: np.ndarray
    mlm_ids: np.ndarray
    predictions: np.ndarray
    next_sentence_labels: np.ndarray
    source_index: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def token_offsets(self) -> np.ndarray:
        return _starts(self.lengths)

    @property
    def mlm_offsets(self) -> np.ndarray:
        return _starts(self.predictions)

    def take(self, index: np.ndarray) -> SequenceStore:
        """The sequences at `index` (any order), as a new store."""
        tok = _ranges(self.token_offsets[index], self.lengths[index])
        mlm = _ranges(self.mlm_offsets[index], self.predictions[index])
        return SequenceStore(
            tokens=self.tokens[tok],
            segments=self.segments[tok],
            lengths=self.lengths[index],
            mlm_positions=self.mlm_positions[mlm],
            mlm_ids=self.mlm_ids[mlm],
            predictions=self.predictions[index],
            next_sentence_labels=self.next_sentence_labels[index],
            source_index=self.source_index[index],
        )

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for f in fields(self):
            np.save(folder / f"{f.name}.npy", getattr(self, f.name))

    @classmethod
    def load_slice(cls, folder: Path, start: int, stop: int) -> SequenceStore:
        """Sequences [start, stop) of a saved store, read through memory maps."""
        arrays = {f.name: np.load(folder / f"{f.name}.npy", mmap_mode="r") for f in fields(cls)}
        lengths = np.asarray(arrays["lengths"][start:stop])
        predictions = np.asarray(arrays["predictions"][start:stop])
        tok0 = int(np.asarray(arrays["lengths"][:start], dtype=np.int64).sum()) if start else 0
        mlm0 = int(np.asarray(arrays["predictions"][:start], dtype=np.int64).sum()) if start else 0
        tok1, mlm1 = tok0 + int(lengths.sum(dtype=np.int64)), mlm0 + int(predictions.sum(dtype=np.int64))
        return cls(
            tokens=np.asarray(arrays["tokens"][tok0:tok1]),
            segments=np.asarray(arrays["segments"][tok0:tok1]),
            lengths=lengths,
            mlm_positions=np.asarray(arrays["mlm_positions"][mlm0:mlm1]),
            mlm_ids=np.asarray(arrays["mlm_ids"][mlm0:mlm1]),
            predictions=predictions,
            next_sentence_labels=np.asarray(arrays["next_sentence_labels"][start:stop]),
            source_index=np.asarray(arrays["source_index"][start:stop]),
        )

    @classmethod
    def concat(cls, stores: list[SequenceStore]) -> SequenceStore:
        return cls(**{f.name: np.concatenate([getattr(s, f.name) for s in stores]) for f in fields(cls)})


def compact_rows(rows: dict, lengths, predictions, source_index, token_dtype) -> SequenceStore:
    """Unpacked rows (ARCHITECTURE.md section 2, padded [n, S] / [n, P]) -> a store of all n rows."""
    lengths = np.asarray(lengths)
    predictions = np.asarray(predictions)
    real = np.arange(rows["input_ids"].shape[1])[None, :] < lengths[:, None]
    used = np.arange(rows["masked_lm_positions"].shape[1])[None, :] < predictions[:, None]
    return SequenceStore(
        tokens=rows["input_ids"][real].astype(token_dtype, copy=False),
        segments=rows["segment_ids"][real].astype(np.uint8, copy=False),
        lengths=lengths.astype(np.uint16),
        mlm_positions=rows["masked_lm_positions"][used].astype(np.uint16, copy=False),
        mlm_ids=rows["masked_lm_ids"][used].astype(token_dtype, copy=False),
        predictions=predictions.astype(np.uint16),
        next_sentence_labels=np.asarray(rows["next_sentence_labels"]).astype(np.uint8),
        source_index=np.asarray(source_index, dtype=np.int64),
    )


def select_rows(rows: dict, index) -> dict:
    """The rows at `index` (a boolean mask or integer array) of every field."""
    return {name: values[index] for name, values in rows.items()}


NARROW = {
    "segment_ids": np.uint8,
    "input_mask": np.uint8,
    "masked_lm_positions": np.uint16,
    "next_sentence_labels": np.uint8,
}


def narrow_rows(rows: dict, token_dtype) -> dict:
    """Validated rows cast to the packed format's small dtypes (less memory to move)."""
    dtypes = dict(NARROW, input_ids=token_dtype, masked_lm_ids=token_dtype)
    return {name: values.astype(dtypes[name], copy=False) for name, values in rows.items()}


def _starts(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) for every (s, c): the flat index of ragged slices."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    begin = _starts(counts)
    return np.repeat(np.asarray(starts, dtype=np.int64) - begin, counts) + np.arange(total)
