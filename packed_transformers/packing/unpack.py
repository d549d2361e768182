"""`python -m packed_transformers.packing unpack`: packed shards back to the unpacked HDF5 layout.

Writes one HDF5 file per original input (same base name, `.h5`), rows in the original
order, with the field dtypes and widths the inputs had (recorded in metadata.json).
Rows skipped by `pack --skip-invalid` are not in the packs: they stay all-zero rows
(row numbers keep their meaning), and the count is printed. Files appear by atomic rename once complete.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from packed_transformers.common.files import atomic_path
from packed_transformers.packing.shards import PackedDataset, extract
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.unpacked_hdf5 import create_unpacked_datasets


def unpacked_name(record: dict, index: int, taken: set) -> str:
    name = Path(record["name"]).stem + ".h5"
    if name in taken:
        name = f"{index:05d}-{name}"
    taken.add(name)
    return name


def run_unpack(packed: Path, output: Path, quiet: bool = False) -> dict:
    import h5py

    dataset = PackedDataset.open(packed)
    meta = dataset.metadata
    output.mkdir(parents=True, exist_ok=True)
    inputs = meta["inputs"]
    starts = np.cumsum([0] + [rec["rows"] for rec in inputs])
    written = np.zeros(int(starts[-1]), dtype=bool)
    taken: set = set()
    names = [unpacked_name(rec, i, taken) for i, rec in enumerate(inputs)]
    for name in names:
        if (output / name).exists():
            raise PackingInputError(f"{output / name} exists; unpack writes into a folder without it")
    with contextlib.ExitStack() as stack:
        files = []
        for rec, name in zip(inputs, names):
            tmp = stack.enter_context(atomic_path(output / name))
            f = stack.enter_context(h5py.File(tmp, "w"))
            widths = rec["widths"]
            nsp_2d = widths.get("NSP_ndim", 1) == 2
            create_unpacked_datasets(f, rec["rows"], widths["S"], widths["P"], rec["dtypes"], nsp_2d)
            files.append(f)
        for shard in range(len(dataset.shards)):
            for _, packs in dataset.blocks(shard):
                _write_rows(extract(packs), files, inputs, starts, written)
        skipped = ~written
        # every file must be complete before any is renamed into place
    result = {
        "files": [str(output / n) for n in names],
        "rows": int(written.sum()),
        "left_out": int(skipped.sum()),
    }
    if not quiet:
        print(f"unpacked {result['rows']} sequences into {len(names)} files in {output}", end="")
        print(
            f"; {result['left_out']} rows skipped at pack time are left as zero rows"
            if result["left_out"]
            else ""
        )
    return result


def _write_rows(store, files, inputs, starts, written) -> None:
    order = np.argsort(store.source_index, kind="stable")
    sources = store.source_index[order]
    if np.any(written[sources]) or np.any(sources[1:] == sources[:-1]):
        raise PackingInputError(
            "a sequence appears twice in the packs (run `python -m packed_transformers.packing verify`)"
        )
    written[sources] = True
    file_of = np.searchsorted(starts, sources, side="right") - 1
    for f in np.unique(file_of).tolist():
        pick = order[file_of == f]
        sub = store.take(pick)
        rows = sub.source_index - int(starts[f])
        s, p = inputs[f]["widths"]["S"], inputs[f]["widths"]["P"]
        n = len(sub)
        real = np.arange(s)[None, :] < sub.lengths[:, None].astype(np.int64)
        used = np.arange(p)[None, :] < sub.predictions[:, None].astype(np.int64)
        arrays = {
            "input_ids": np.zeros((n, s), np.int64),
            "input_mask": real.astype(np.int64),
            "segment_ids": np.zeros((n, s), np.int64),
            "masked_lm_positions": np.zeros((n, p), np.int64),
            "masked_lm_ids": np.zeros((n, p), np.int64),
            "next_sentence_labels": sub.next_sentence_labels.astype(np.int64),
        }
        arrays["input_ids"][real] = sub.tokens
        arrays["segment_ids"][real] = sub.segments
        arrays["masked_lm_positions"][used] = sub.mlm_positions
        arrays["masked_lm_ids"][used] = sub.mlm_ids
        handle = files[f]
        for field, values in arrays.items():
            target = handle[field]
            if field == "next_sentence_labels" and target.ndim == 2:
                values = values[:, None]
            target[rows.tolist()] = values.astype(target.dtype)
