"""Writing unpacked pretraining shards in the NVIDIA/MLCommons HDF5 layout (DESIGN.md section 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packing.io_utils import atomic_path

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


def write_unpacked_shard(path: Path, arrays: dict, vocab_size: int = 30522) -> None:
    """Write one shard atomically. arrays: the six fields, [n, S] / [n, P] / [n]."""
    import h5py

    dtypes = dtypes_for(vocab_size)
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            for name, dtype in dtypes.items():
                f.create_dataset(name, data=np.asarray(arrays[name]).astype(dtype), track_times=False)
