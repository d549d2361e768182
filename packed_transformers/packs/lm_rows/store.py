"""Causal-LM rows on disk: a folder of metadata.json + part-NNNNN.h5 (h5py), the format
`packed pack-documents` writes and decoder pretraining reads.

    metadata.json   format "packed-lm-rows", version, layout, S, K, rows, real_tokens,
                    documents, split_documents, left_out_tokens, vocab_size, eos_id,
                    tokenizer (what it was made with), shards [{file, rows, sha256}]
    part-00000.h5   input_ids, sequence_ids, position_ids, document_ids, document_offsets:
                    [rows, S] each (packs.lm_rows.layouts.Rows)

Written into a temporary folder and renamed into place (nothing half-written); opened with
every shard's shape and integer dtype checked from its header and, where asked, its sha256,
then every row checked against the format (packs.lm_rows.row_rule) a block at a time.
"""

from __future__ import annotations

import errno
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.files import atomic_folder, sha256_file
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.lm_rows.layouts import LAYOUTS, Rows
from packed_transformers.packs.lm_rows.row_rule import first_malformed_row

FORMAT = "packed-lm-rows"
VERSION = 1
ROWS_PER_SHARD = 4096


def _dtypes(length: int, depth: int, vocab_size: int) -> dict:
    return {
        "input_ids": np.uint16 if vocab_size <= 1 << 16 else np.int32,
        "sequence_ids": np.uint8 if depth < 1 << 8 else np.uint16,
        "position_ids": np.uint16 if length <= 1 << 16 else np.int32,
        "document_ids": np.int32,
        "document_offsets": np.int32,
    }


def write_rows(folder: Path, rows: Rows, vocab_size: int, eos_id: int, about: dict) -> dict:
    """Write `rows` as a new folder (replacing only what `folder` held before, atomically).
    about: what else metadata.json records (the tokenizer, the documents, the source)."""
    count, length = rows.input_ids.shape
    dtypes = _dtypes(length, rows.depth, vocab_size)
    if int(rows.input_ids.max(initial=0)) >= vocab_size:
        raise PackingInputError(
            f"a token id {int(rows.input_ids.max())} is not below vocab_size {vocab_size}"
        )
    import h5py

    shards = []
    with atomic_folder(folder) as tmp:
        for number, start in enumerate(range(0, count, ROWS_PER_SHARD)):
            name = f"part-{number:05d}.h5"
            try:
                with h5py.File(tmp / name, "w") as f:
                    for field, values in rows.fields().items():
                        f.create_dataset(
                            field, data=values[start : start + ROWS_PER_SHARD].astype(dtypes[field])
                        )
            except (OSError, RuntimeError) as err:  # h5py's close after a failed write raises RuntimeError
                raise write_failed(folder / name, err) from None
            shards.append(
                {"file": name, "rows": min(ROWS_PER_SHARD, count - start), "sha256": sha256_file(tmp / name)}
            )
        metadata = {
            "format": FORMAT,
            "version": VERSION,
            "layout": rows.layout,
            "S": length,
            "K": rows.depth,
            "rows": count,
            "real_tokens": rows.real_tokens,
            "split_documents": rows.split_documents,
            "left_out_tokens": rows.left_out_tokens,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            **about,
            "shards": shards,
        }
        (tmp / "metadata.json").write_text(json.dumps(metadata, indent=1) + "\n")
    return metadata


# Rows read and checked at a time when a store is opened: about 1 M tokens a block, so the
# memory of the check is bounded by a block and the store's by the rows that passed it.
BLOCK_TOKENS = 1 << 20


@dataclass
class RowStore:
    """An opened folder: metadata and every row in memory in its stored dtype ([rows, S]
    arrays of uint8..int32; the folders a CPU run reads are small, a reader of 8192-token C4 at
    scale would map shards), each row checked against the format when opened."""

    folder: Path
    metadata: dict
    fields: dict

    @property
    def rows(self) -> int:
        return self.metadata["rows"]

    @property
    def length(self) -> int:
        return self.metadata["S"]

    @property
    def vocab_size(self) -> int:
        return self.metadata["vocab_size"]

    @property
    def layout(self) -> str:
        """packs.lm_rows.layouts.LAYOUTS: "documents" (document-masked packs) or "concatenated"."""
        return self.metadata["layout"]

    def batch(self, indices) -> dict[str, np.ndarray]:
        """The rows at `indices`: input_ids, sequence_ids, position_ids [n, S] int64."""
        return {
            name: self.fields[name][indices].astype(np.int64)
            for name in ("input_ids", "sequence_ids", "position_ids")
        }

    @classmethod
    def open(cls, folder, check_sha256: bool = True) -> RowStore:
        """PackingInputError (one line naming the folder, file, field or row) unless `folder`
        is this format, whole and as its metadata describes it. Sizes are checked from the
        metadata and the HDF5 headers before any row is read; rows are read a block at a
        time, each block checked against the format (packs.lm_rows.row_rule) before the
        next; the real tokens counted are compared with the metadata's."""
        folder = Path(folder)
        meta_file = folder / "metadata.json"
        metadata = _read_metadata(folder, meta_file)
        import h5py

        parts = {name: [] for name in Rows.FIELDS}
        real_tokens, row_number = 0, 0
        for shard in metadata["shards"]:
            path = folder / shard["file"]
            if check_sha256 and sha256_file(path) != shard.get("sha256"):
                raise PackingInputError(
                    f"{path}: does not match its sha256 in metadata.json (corrupt or edited)"
                )
            try:
                with h5py.File(path, "r") as f:
                    datasets = _shard_datasets(f, path, shard["rows"], metadata["S"])
                    block = max(1, BLOCK_TOKENS // metadata["S"])
                    for start in range(0, shard["rows"], block):
                        values = {name: d[start : start + block] for name, d in datasets.items()}
                        fault = first_malformed_row(values, metadata["K"], metadata["vocab_size"],
                                                    metadata.get("documents_in"), metadata["layout"])  # fmt: skip
                        if fault is not None:
                            raise PackingInputError(
                                f"{path}: row {start + fault.row} (row {row_number + start + fault.row} of the "
                                f"folder) breaks the row format: {fault.rule}"
                            )
                        real_tokens += int((values["sequence_ids"] > 0).sum())
                        for name, array in values.items():
                            parts[name].append(array)
            except OSError as err:
                raise PackingInputError(f"{path}: not a readable HDF5 file ({err})") from None
            row_number += shard["rows"]
        if metadata.get("real_tokens") != real_tokens:
            raise PackingInputError(
                f"{meta_file}: real_tokens {metadata.get('real_tokens')!r} but the rows hold {real_tokens} "
                "real tokens (sequence id > 0)"
            )
        fields = {name: np.concatenate(values) for name, values in parts.items()}
        return cls(folder, metadata, fields)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _read_metadata(folder: Path, meta_file: Path) -> dict:
    """metadata.json, its keys and its shard list checked (no shard read)."""
    if not meta_file.is_file():
        raise PackingInputError(f"{folder}: no metadata.json (expected `packed pack-documents` output)")
    try:
        metadata = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        raise PackingInputError(f"{meta_file}: not JSON ({err})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise PackingInputError(
            f"{meta_file}: format is not {FORMAT!r} (expected `packed pack-documents` output)"
        )
    if metadata.get("version") != VERSION:
        raise PackingInputError(
            f"{meta_file}: version {str(metadata.get('version'))[:40]!r}, this reader reads {VERSION}"
        )
    for key in ("S", "K", "rows", "vocab_size"):
        if not _positive_int(metadata.get(key)):
            raise PackingInputError(f"{meta_file}: {key} must be a positive integer")
    if metadata.get("layout") not in LAYOUTS:
        raise PackingInputError(f"{meta_file}: layout must be one of {', '.join(LAYOUTS)}")
    if "documents_in" in metadata and not _positive_int(metadata["documents_in"]):
        raise PackingInputError(f"{meta_file}: documents_in must be a positive integer")
    shards = metadata.get("shards")
    if not isinstance(shards, list) or not all(isinstance(shard, dict) for shard in shards):
        raise PackingInputError(f"{meta_file}: shards must be a list of {{file, rows, sha256}} objects")
    for number, shard in enumerate(shards):
        name = shard.get("file")
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            raise PackingInputError(f"{folder}: shard {str(name)[:80]} (shards[{number}]) is missing")
        if not _positive_int(shard.get("rows")):
            raise PackingInputError(f"{meta_file}: shards[{number}].rows must be a positive integer")
    if sum(shard["rows"] for shard in shards) != metadata["rows"]:
        raise PackingInputError(
            f"{meta_file}: rows {metadata['rows']} but the shards' rows add up to "
            f"{sum(shard['rows'] for shard in shards)}"
        )
    return metadata


def _shard_datasets(f, path: Path, rows: int, length: int) -> dict:
    """Every field's h5py dataset, its shape and dtype checked from the header (nothing read)."""
    import h5py

    datasets = {}
    for name in Rows.FIELDS:
        if name not in f or not isinstance(f[name], h5py.Dataset):
            raise PackingInputError(f"{path}: field {name} is missing")
        dataset = f[name]
        if dataset.dtype.kind not in "iu" or dataset.dtype.itemsize > 4 or dataset.shape != (rows, length):
            raise PackingInputError(
                f"{path}: field {name} is {dataset.dtype} {dataset.shape}, expected integers of at most 32 "
                f"bits [{rows}, {length}] (metadata.json)"
            )
        datasets[name] = dataset
    return datasets


def write_failed(path: Path, err: BaseException) -> OSError:
    """h5py's failed write (an OSError or, from the close that follows it, a RuntimeError, with
    HDF5's multi-line report) -> one OSError naming `path` and the system's reason."""
    text = str(err)
    found = re.search(r"error message = '([^']+)'", text)
    reason = found.group(1) if found else " ".join(text.split())[:160]
    return OSError(errno.EIO, f"writing the rows failed ({reason}; no space left on the device, a file-size "
                   "limit or a read-only folder?)", str(path))  # fmt: skip
