"""Causal-LM rows on disk: a folder of metadata.json + part-NNNNN.h5 (h5py), the format
`packed pack-documents` writes and decoder pretraining reads.

    metadata.json   format "packed-lm-rows", version, layout, S, K, rows, real_tokens,
                    documents, split_documents, left_out_tokens, vocab_size, eos_id,
                    tokenizer (what it was made with), shards [{file, rows, sha256}]
    part-00000.h5   input_ids, sequence_ids, position_ids, document_ids, document_offsets:
                    [rows, S] each (packing.lm_rows.layouts.Rows)

Written into a temporary folder and renamed into place (nothing half-written); opened with
every shard's shape and integer dtype checked and, where asked, its sha256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.files import atomic_folder, sha256_file
from packing.errors import PackingInputError
from packing.lm_rows.layouts import Rows

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
            with h5py.File(tmp / name, "w") as f:
                for field, values in rows.fields().items():
                    f.create_dataset(field, data=values[start : start + ROWS_PER_SHARD].astype(dtypes[field]))
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


@dataclass
class RowStore:
    """An opened folder: metadata and every row in memory as int64 [rows, S] arrays (the
    folders a CPU run reads are small; a reader of 8192-token C4 at scale would map shards)."""

    folder: Path
    metadata: dict
    fields: dict

    @property
    def rows(self) -> int:
        return self.metadata["rows"]

    @property
    def length(self) -> int:
        return self.metadata["S"]

    def batch(self, indices) -> dict[str, np.ndarray]:
        """The rows at `indices`: input_ids, sequence_ids, position_ids [n, S] int64."""
        return {name: self.fields[name][indices] for name in ("input_ids", "sequence_ids", "position_ids")}

    @classmethod
    def open(cls, folder, check_sha256: bool = True) -> RowStore:
        """PackingInputError (one line naming the folder, file or field) unless `folder` is
        this format, whole and as its metadata describes it."""
        folder = Path(folder)
        meta_file = folder / "metadata.json"
        if not meta_file.is_file():
            raise PackingInputError(f"{folder}: no metadata.json (expected `packed pack-documents` output)")
        try:
            metadata = json.loads(meta_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise PackingInputError(f"{meta_file}: not JSON ({err})") from None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
            raise PackingInputError(
                f"{meta_file}: format is not {FORMAT!r} (expected `packed pack-documents` output)"
            )
        if metadata.get("version") != VERSION:
            raise PackingInputError(
                f"{meta_file}: version {metadata.get('version')!r}, this reader reads {VERSION}"
            )
        for key in ("S", "K", "rows", "vocab_size"):
            if not isinstance(metadata.get(key), int) or metadata[key] < 1:
                raise PackingInputError(f"{meta_file}: {key} must be a positive integer")
        shards = metadata.get("shards")
        if not isinstance(shards, list) or not all(isinstance(shard, dict) for shard in shards):
            raise PackingInputError(f"{meta_file}: shards must be a list of {{file, rows, sha256}} objects")
        import h5py

        parts = {name: [] for name in Rows.FIELDS}
        for shard in shards:
            path = folder / str(shard.get("file"))
            if not path.is_file():
                raise PackingInputError(f"{folder}: shard {shard.get('file')} is missing")
            if check_sha256 and sha256_file(path) != shard.get("sha256"):
                raise PackingInputError(
                    f"{path}: does not match its sha256 in metadata.json (corrupt or edited)"
                )
            try:
                with h5py.File(path, "r") as f:
                    for name in Rows.FIELDS:
                        if name not in f or not isinstance(f[name], h5py.Dataset):
                            raise PackingInputError(f"{path}: field {name} is missing")
                        values = f[name][()]
                        if values.dtype.kind not in "iu" or values.shape != (
                            shard.get("rows"),
                            metadata["S"],
                        ):
                            raise PackingInputError(
                                f"{path}: field {name} is {values.dtype} {values.shape}, expected integers "
                                f"[{shard.get('rows')}, {metadata['S']}]"
                            )
                        parts[name].append(values.astype(np.int64))
            except OSError as err:
                raise PackingInputError(f"{path}: not a readable HDF5 file ({err})") from None
        fields = {name: np.concatenate(values) if values else None for name, values in parts.items()}
        if fields["input_ids"] is None or len(fields["input_ids"]) != metadata["rows"]:
            raise PackingInputError(
                f"{meta_file}: rows {metadata['rows']} but the shards hold a different count"
            )
        if fields["input_ids"].max() >= metadata["vocab_size"] or fields["input_ids"].min() < 0:
            raise PackingInputError(
                f"{folder}: a token id outside 0..vocab_size-1 ({metadata['vocab_size']})"
            )
        return cls(folder, metadata, fields)
