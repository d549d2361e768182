"""Sequence-length histograms: the only input the packing algorithms see.

A histogram of maximum length N is an int64 array `counts` of shape [N] where
counts[i] is the number of sequences of length i + 1 tokens (bin size 1,
lengths 1..N). JSON files use the same convention:
`{"max_sequence_length": N, "counts": [...]}` (other keys are ignored), the
format of shared/data/histograms/.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common import json_text
from packed_transformers.packs.errors import PackingInputError


@dataclass(frozen=True)
class Histogram:
    """counts[i] = number of sequences of length i + 1; len(counts) = N."""

    counts: np.ndarray  # int64 [N]

    def __post_init__(self):
        counts = np.asarray(self.counts)
        if counts.ndim != 1 or counts.size < 1:
            raise PackingInputError(
                f"histogram counts must be a non-empty 1-D list, got shape {counts.shape}"
            )
        if counts.dtype.kind not in "iu":
            raise PackingInputError(f"histogram counts must be integers, got dtype {counts.dtype}")
        if (counts < 0).any():
            bad = int(np.flatnonzero(counts < 0)[0])
            raise PackingInputError(
                f"histogram counts must be >= 0; counts[{bad}] (length {bad + 1}) = {counts[bad]}"
            )
        if counts.sum() == 0:
            raise PackingInputError("histogram is empty: all counts are 0")
        object.__setattr__(self, "counts", counts.astype(np.int64, copy=False))

    @property
    def max_sequence_length(self) -> int:
        return int(self.counts.size)

    @property
    def lengths(self) -> np.ndarray:
        """int64 [N]: the length of each bin, 1..N."""
        return np.arange(1, self.counts.size + 1, dtype=np.int64)

    @property
    def sequences(self) -> int:
        return int(self.counts.sum())

    @property
    def real_tokens(self) -> int:
        return int((self.counts * self.lengths).sum())

    @property
    def padding_fraction_unpacked(self) -> float:
        """Fraction of padding tokens when every sequence gets its own row of N tokens."""
        return 1.0 - self.real_tokens / (self.sequences * self.max_sequence_length)

    @property
    def theoretical_speedup(self) -> float:
        """N * sequences / real tokens: the speed-up of a perfect packing (no padding at all)."""
        return self.max_sequence_length * self.sequences / self.real_tokens

    @classmethod
    def from_lengths(cls, lengths, max_sequence_length: int) -> Histogram:
        """Histogram of integer sequence lengths, each in 1..max_sequence_length."""
        check_sequence_length("max_sequence_length", max_sequence_length)
        lengths = np.asarray(lengths)
        if lengths.size == 0:
            raise PackingInputError("no sequence lengths given: the histogram would be empty")
        if lengths.dtype.kind not in "iu":
            raise PackingInputError(f"sequence lengths must be integers, got dtype {lengths.dtype}")
        out_of_range = (lengths < 1) | (lengths > max_sequence_length)
        if out_of_range.any():
            row = int(np.flatnonzero(out_of_range)[0])
            raise PackingInputError(
                f"sequence length at row {row} is {lengths[row]}, expected 1..{max_sequence_length}"
            )
        counts = np.bincount(lengths.astype(np.int64) - 1, minlength=max_sequence_length)
        return cls(counts.astype(np.int64))

    @classmethod
    def from_json_file(cls, path: str | Path) -> Histogram:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise PackingInputError(f"{path}: histogram file not found") from None
        except OSError as err:
            raise PackingInputError(f"{path}: cannot read histogram file: {err.strerror}") from None
        try:
            data = json_text.loads(text)
        except json.JSONDecodeError as err:
            raise PackingInputError(f"{path}: malformed JSON: {err}") from None
        try:
            return cls.from_dict(data)
        except PackingInputError as err:
            raise PackingInputError(f"{path}: {err}") from None

    @classmethod
    def from_dict(cls, data) -> Histogram:
        """Parse `{"max_sequence_length": N, "counts": [...]}`; other keys are ignored."""
        if not isinstance(data, dict):
            raise PackingInputError("expected a JSON object with keys max_sequence_length, counts")
        for key in ("max_sequence_length", "counts"):
            if key not in data:
                raise PackingInputError(f"missing key '{key}'")
        n = data["max_sequence_length"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PackingInputError(f"max_sequence_length must be an integer >= 1, got {n!r}")
        counts = data["counts"]
        if not isinstance(counts, list):
            raise PackingInputError(f"counts must be a list, got {type(counts).__name__}")
        if len(counts) != n:
            raise PackingInputError(
                f"counts has {len(counts)} entries, expected max_sequence_length = {n} "
                "(counts[i] = sequences of length i+1)"
            )
        for i, c in enumerate(counts):
            if isinstance(c, bool) or not isinstance(c, (int, float)):
                raise PackingInputError(f"counts[{i}] must be a number, got {c!r}")
            if isinstance(c, float) and (not math.isfinite(c) or c != int(c)):
                raise PackingInputError(f"counts[{i}] must be a finite integer, got {c!r}")
            if c < 0:
                raise PackingInputError(f"counts[{i}] must be >= 0, got {c!r}")
        return cls(np.array([int(c) for c in counts], dtype=np.int64))


# The longest row any packer or pack reader takes (common.input_limits: 1 M tokens).
from packed_transformers.common.input_limits import MAX_SEQUENCE_LENGTH  # noqa: E402


def check_sequence_length(name: str, value) -> None:
    """PackingInputError naming `name` unless value is an integer in 1..MAX_SEQUENCE_LENGTH."""
    check_positive_int(name, value)
    if value > MAX_SEQUENCE_LENGTH:
        raise PackingInputError(f"{name} must be at most {MAX_SEQUENCE_LENGTH:,} tokens, got {value:,}")


def check_positive_int(name: str, value) -> None:
    """PackingInputError naming `name` unless value is an integer >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PackingInputError(f"{name} must be an integer >= 1, got {value!r}")
