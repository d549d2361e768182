"""Unpacked pretraining shards (ARCHITECTURE.md section 2): finding, reading and validating them.

Two on-disk layouts are read, both one row per sequence, zero padded to width S:
  * HDF5 (NVIDIA / MLCommons conversion) through h5py, any integer dtypes;
  * TFRecord of tf.train.Example (MLCommons reference, Graphcore) through the pure-Python
    `tfrecord` package: no TensorFlow. A first scan records the byte offset of every
    record so that later passes can read any row range. Both CRCs of every record (of
    its length, at the scan; of its bytes, at each read) are checked with the `crc32c`
    package, as TensorFlow's reader does: a flipped bit is refused naming the record,
    not packed as a different token. (Measured: 1.3 us for a 4.3 kB record of S=512 against
    116 us to parse it, so there is no option to skip it.)

Every reader returns row ranges as a dict of numpy arrays with the field names of
ARCHITECTURE.md section 2 (`next_sentence_labels` flattened to [n]). `validate_rows` checks a
range and returns per-row lengths and prediction counts, or the first bad row.
"""

from __future__ import annotations

import glob
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.files import sha256_file
from packed_transformers.packs.errors import PackingInputError

FIELDS = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)
TOKEN_FIELDS = ("input_ids", "input_mask", "segment_ids")
PREDICTION_FIELDS = ("masked_lm_positions", "masked_lm_ids")


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files matching each glob, in the order the globs were given (sorted within a glob).

    The order defines the global sequence index (source_index): inputs in order, rows in
    file order. An empty glob or a file listed twice is an error, never a silent skip.
    """
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
        if not matches:
            raise PackingInputError(f"--input {pattern!r} matches no file")
        files.extend(Path(p) for p in matches)
    seen = set()
    for path in files:
        key = path.resolve()
        if key in seen:
            raise PackingInputError(f"input file {path} is given twice (check overlapping --input globs)")
        seen.add(key)
    return files


def file_record(path) -> dict:
    """Name, size and sha256 of one file, as metadata.json lists inputs and shards."""
    path = Path(path)
    return {"name": str(path), "bytes": path.stat().st_size, "sha256": sha256_file(path)}


# --------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------
class HDF5Source:
    """Row ranges of one unpacked HDF5 file. Opened lazily so that it can cross fork()."""

    kind = "hdf5"

    def __init__(self, path: Path):
        import h5py

        self.path = Path(path)
        try:
            with h5py.File(self.path, "r") as f:
                missing = [name for name in FIELDS if name not in f]
                if missing:
                    raise PackingInputError(
                        f"{self.path}: field '{missing[0]}' is missing (an unpacked shard needs "
                        f"{', '.join(FIELDS)})"
                    )
                shapes = {name: f[name].shape for name in FIELDS}
                dtypes = {name: f[name].dtype for name in FIELDS}
        except OSError as err:
            raise PackingInputError(f"{self.path}: not a readable HDF5 file ({err})") from None
        self.shapes = shapes
        self.dtypes = {name: np.dtype(d).str for name, d in dtypes.items()}
        for name, dtype in dtypes.items():
            if not np.issubdtype(dtype, np.integer):
                raise PackingInputError(f"{self.path}: field '{name}' has dtype {dtype}, expected integers")
        self.rows = _check_shapes(self.path, shapes)
        self.width = shapes["input_ids"][1]
        self.predictions_width = shapes["masked_lm_positions"][1]
        self._file = None

    def read(self, start: int, stop: int) -> dict:
        import h5py

        try:
            if self._file is None:
                self._file = h5py.File(self.path, "r")
            out = {name: self._file[name][start:stop] for name in FIELDS}
        except OSError as err:
            raise PackingInputError(
                f"{self.path}: rows {start}..{stop - 1} cannot be read, the file is truncated or corrupt "
                f"({err})"
            ) from None
        out["next_sentence_labels"] = out["next_sentence_labels"].reshape(stop - start)
        return out

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def _check_shapes(path, shapes) -> int:
    rows = shapes["input_ids"][0]
    for name in FIELDS:
        shape = shapes[name]
        if shape[0] != rows:
            raise PackingInputError(
                f"{path}: field '{name}' has {shape[0]} rows, 'input_ids' has {rows} (fields must match)"
            )
        expected_ndim = (1, 2) if name == "next_sentence_labels" else (2,)
        if len(shape) not in expected_ndim or (
            name == "next_sentence_labels" and shape[1:] not in ((), (1,))
        ):
            raise PackingInputError(
                f"{path}: field '{name}' has shape {shape}, expected "
                + ("[n] or [n, 1]" if name == "next_sentence_labels" else "[n, width]")
            )
    for group in (TOKEN_FIELDS, PREDICTION_FIELDS):
        width = shapes[group[0]][1]
        for name in group:
            if shapes[name][1] != width:
                raise PackingInputError(
                    f"{path}: field '{name}' has width {shapes[name][1]}, '{group[0]}' has {width}"
                )
    return rows


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data` (tensorflow/core/lib/hash/crc32c.h: Mask)."""
    import crc32c

    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class TFRecordSource:
    """Row ranges of one TFRecord file of tf.train.Example records (int64 features)."""

    kind = "tfrecord"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offsets = self._scan()
        self.rows = len(self.offsets) - 1
        if self.rows == 0:
            self.shapes = {name: (0, 0) for name in FIELDS}
            self.width = self.predictions_width = 0
        else:
            first = self.read(0, 1)
            self.width = first["input_ids"].shape[1]
            self.predictions_width = first["masked_lm_positions"].shape[1]
            self.shapes = {name: (self.rows, *first[name].shape[1:]) for name in FIELDS}
        self.dtypes = {name: np.dtype(np.int64).str for name in FIELDS}

    def _scan(self) -> np.ndarray:
        """Byte offsets of every record (and of the end), checking the framing."""
        offsets = [0]
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            while offsets[-1] < size:
                header = f.read(12)
                if len(header) < 12:
                    raise PackingInputError(f"{self.path}: record {len(offsets) - 1} is truncated")
                (length,) = struct.unpack("<Q", header[:8])
                if _masked_crc(header[:8]) != struct.unpack("<I", header[8:])[0]:
                    raise PackingInputError(
                        f"{self.path}: record {len(offsets) - 1}: the length's CRC does not match (a corrupt file)"
                    )
                end = offsets[-1] + 12 + length + 4
                if end > size:
                    raise PackingInputError(f"{self.path}: record {len(offsets) - 1} is truncated")
                f.seek(end)
                offsets.append(end)
        return np.asarray(offsets, dtype=np.int64)

    def read(self, start: int, stop: int) -> dict:
        from tfrecord import example_pb2

        columns: dict[str, list] = {name: [] for name in FIELDS}
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[start]))
            blob = f.read(int(self.offsets[stop] - self.offsets[start]))
        pos = 0
        for row in range(start, stop):
            (length,) = struct.unpack_from("<Q", blob, pos)
            record = blob[pos + 12 : pos + 12 + length]
            if _masked_crc(record) != struct.unpack_from("<I", blob, pos + 12 + length)[0]:
                raise PackingInputError(
                    f"{self.path}: row {row}: the record's CRC does not match its bytes (a corrupt file)"
                )
            example = example_pb2.Example()
            try:
                example.ParseFromString(record)
            except Exception as err:  # protobuf raises its own DecodeError
                raise PackingInputError(f"{self.path}: row {row} is not a tf.train.Example ({err})") from None
            pos += 12 + length + 4
            feature = example.features.feature
            for name in FIELDS:
                if name not in feature:
                    raise PackingInputError(f"{self.path}: row {row}: field '{name}' is missing")
                columns[name].append(feature[name].int64_list.value)
        out = {}
        for name, values in columns.items():
            widths = {len(v) for v in values}
            if len(widths) > 1:
                raise PackingInputError(
                    f"{self.path}: rows {start}..{stop - 1}: field '{name}' has varying widths {sorted(widths)}"
                )
            out[name] = np.asarray(values, dtype=np.int64).reshape(len(values), -1)
        out["next_sentence_labels"] = out["next_sentence_labels"].reshape(stop - start)
        return out

    def close(self):
        pass


def open_source(path) -> HDF5Source | TFRecordSource:
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic == b"\x89HDF\r\n\x1a\n":
        return HDF5Source(path)
    if path.suffix in (".tfrecord", ".tfrecords") or "tfrecord" in path.name:
        return TFRecordSource(path)
    raise PackingInputError(f"{path}: neither an HDF5 file nor a TFRecord file (*.tfrecord)")


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What a valid row must respect: S tokens, P predictions, token ids below vocab_size."""

    max_sequence_length: int
    max_predictions_per_seq: int
    vocab_size: int | None = None
    vocab_note: str = ""  # said after a token-id complaint (where the bound comes from)


def check_source_shape(source, limits: Limits) -> None:
    if source.rows and source.width != limits.max_sequence_length:
        raise PackingInputError(
            f"{source.path}: field 'input_ids' has width {source.width}, expected "
            f"--max-sequence-length {limits.max_sequence_length}"
        )


def validate_rows(rows: dict, limits: Limits, path, row0: int):
    """Check every row of a range (ARCHITECTURE.md section 2).

    Returns (lengths int32 [n], predictions int32 [n], problems) where problems lists
    (row, field, message) for bad rows, first problem per row. Lengths count real tokens;
    predictions count the used masked-LM slots (a prefix of non-zero positions: position 0
    is [CLS], never masked, and marks unused slots).
    """
    ids = rows["input_ids"]
    n, width = ids.shape
    mask = rows["input_mask"]
    lengths = np.count_nonzero(mask, axis=1).astype(np.int32)
    inside = np.arange(width)[None, :] < lengths[:, None]
    bad = {}

    def flag(field, row_mask, message):
        for r in np.flatnonzero(row_mask).tolist():
            bad.setdefault(r, (field, message(r)))

    flag("input_mask", (mask != inside).any(axis=1), lambda r: "must be a prefix of ones then zeros")
    flag("input_mask", lengths < 1, lambda r: "has no real token (length 0)")
    flag(
        "input_ids",
        ((ids < 0) & inside).any(axis=1),
        lambda r: f"holds a negative token id {int(ids[r].min())}",
    )
    if limits.vocab_size is not None:
        flag(
            "input_ids",
            ((ids >= limits.vocab_size) & inside).any(axis=1),
            lambda r: (
                f"holds token id {int(ids[r].max())}, outside the vocabulary of {limits.vocab_size}{limits.vocab_note}"
            ),
        )
    segments = rows["segment_ids"]
    flag(
        "segment_ids",
        (((segments != 0) & (segments != 1)) & inside).any(axis=1),
        lambda r: "holds a value other than 0 or 1",
    )
    positions = rows["masked_lm_positions"]
    labels = rows["masked_lm_ids"]
    used = positions != 0
    predictions = np.count_nonzero(used, axis=1).astype(np.int32)
    prefix = np.arange(positions.shape[1])[None, :] < predictions[:, None]
    flag("masked_lm_positions", (used != prefix).any(axis=1), lambda r: "unused slots (0) must come last")
    flag(
        "masked_lm_positions",
        predictions > limits.max_predictions_per_seq,
        lambda r: (
            f"has {int(predictions[r])} predictions, more than --max-predictions-per-seq "
            f"{limits.max_predictions_per_seq}"
        ),
    )
    flag(
        "masked_lm_positions",
        ((positions < 0) | (positions >= lengths[:, None])).any(axis=1),
        lambda r: f"position {int(positions[r].max())} is outside the sequence of length {int(lengths[r])}",
    )
    flag(
        "masked_lm_ids",
        ((labels != 0) & ~used).any(axis=1),
        lambda r: "holds a non-zero label in an unused slot",
    )
    flag("masked_lm_ids", (labels < 0).any(axis=1), lambda r: "holds a negative token id")
    if limits.vocab_size is not None:
        flag(
            "masked_lm_ids",
            (labels >= limits.vocab_size).any(axis=1),
            lambda r: (
                f"holds token id {int(labels[r].max())}, outside the vocabulary of {limits.vocab_size}{limits.vocab_note}"
            ),
        )
    nsp = rows["next_sentence_labels"]
    flag("next_sentence_labels", (nsp != 0) & (nsp != 1), lambda r: f"is {int(nsp[r])}, expected 0 or 1")
    problems = [(row0 + r, field, message) for r, (field, message) in sorted(bad.items())]
    return lengths, predictions, problems


def describe_problem(path, row, field, message) -> str:
    return f"{path}: row {row}: field '{field}' {message}"
