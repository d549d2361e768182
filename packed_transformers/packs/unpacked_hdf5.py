"""Writing unpacked pretraining shards in the NVIDIA/MLCommons HDF5 layout (ARCHITECTURE.md section 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packed_transformers.common.constants import BERT_VOCAB_SIZE
from packed_transformers.common.files import atomic_path

# The dtypes of MLCommons' phase-2 HDF5 conversion: small ints, vocab < 32768.
DTYPES = {
    "input_ids": np.int16,
    "input_mask": np.int8,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int16,
    "masked_lm_ids": np.int16,
    "next_sentence_labels": np.int8,
}


def dtypes_for(vocab_size: int) -> dict:
    out = dict(DTYPES)
    if vocab_size > np.iinfo(np.int16).max + 1:
        out["input_ids"] = out["masked_lm_ids"] = np.int32
    return out


def create_unpacked_datasets(f, rows: int, s: int, p: int, dtypes: dict, nsp_2d: bool = False) -> dict:
    """The six fields as zero-filled datasets of an open h5py file: [rows, S] / [rows, P] /
    [rows] ([rows, 1] with `nsp_2d`, as some producers write it). The one writer of the
    layout: data creation, synthetic shards and `packing unpack` fill these."""
    widths = {
        "input_ids": s,
        "input_mask": s,
        "segment_ids": s,
        "masked_lm_positions": p,
        "masked_lm_ids": p,
        "next_sentence_labels": 1 if nsp_2d else None,
    }
    return {
        name: f.create_dataset(
            name,
            shape=(rows,) if width is None else (rows, width),
            dtype=np.dtype(dtypes[name]),
            fillvalue=0,
            track_times=False,
        )
        for name, width in widths.items()
    }


def write_unpacked_shard(path: Path, arrays: dict, vocab_size: int = BERT_VOCAB_SIZE) -> None:
    """Write one shard atomically. arrays: the six fields, [n, S] / [n, P] / [n]."""
    import h5py

    rows, s = np.shape(arrays["input_ids"])
    p = np.shape(arrays["masked_lm_positions"])[1]
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            for name, dataset in create_unpacked_datasets(f, rows, s, p, dtypes_for(vocab_size)).items():
                if rows:
                    dataset[...] = np.asarray(arrays[name])
