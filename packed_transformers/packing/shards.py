"""Packed shards (ARCHITECTURE.md section 3): assembling, writing, reading and unpacking them.

`assemble` turns an assignment block [p, K] plus the compact sequences it names into
packed rows; `extract` is its inverse (packs -> compact sequences), used by verify,
unpack and the tests. `PackedDataset` opens a packed directory for readers (training).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.constants import BERT_VOCAB_SIZE
from packed_transformers.common.files import not_a_file, sha256_file
from packed_transformers.packing.compact import SequenceStore, _ranges, _starts
from packed_transformers.packing.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    PACKED_FIELDS,
    empty_packs,
    field_dtypes,
)
from packed_transformers.packs.errors import PackingInputError

METADATA = "metadata.json"


def shard_name(index: int) -> str:
    return f"part-{index:05d}.h5"


def assemble(table: np.ndarray, store: SequenceStore, s: int, m: int, vocab_size: int) -> dict:
    """Packed rows for `table` int64 [p, K] (global indices, -1 = empty slot).

    `store` must hold every sequence the table names (any order). Raises ValueError if
    a pack would exceed S tokens or M masked-LM slots: a wrong plan, never truncated.
    """
    p, k = table.shape
    out = empty_packs(p, s, k, m, vocab_size)
    rows, slots = np.nonzero(table >= 0)  # row-major: pack order, then slot order
    sources = table[rows, slots]
    order = np.argsort(store.source_index, kind="stable")
    where = np.searchsorted(store.source_index, sources, sorter=order)
    where = order[np.minimum(where, order.size - 1)]
    if not np.array_equal(store.source_index[where], sources):
        raise ValueError("assignment names a sequence the store does not hold")
    lengths = store.lengths[where].astype(np.int64)
    predictions = store.predictions[where].astype(np.int64)
    first_of_row = np.searchsorted(rows, np.arange(p))
    token_start = _starts(lengths)
    offset = token_start - token_start[first_of_row][rows]  # where each sequence starts in its pack
    if (offset + lengths > s).any():
        raise ValueError(f"a pack needs more than S={s} tokens")
    mlm_start = _starts(predictions)
    slot0 = mlm_start - mlm_start[first_of_row][rows]
    if (slot0 + predictions > m).any():
        raise ValueError(f"a pack needs more than M={m} masked-LM slots")

    src_tok = _ranges(store.token_offsets[where], lengths)
    within = np.arange(src_tok.size) - np.repeat(token_start, lengths)
    dst_tok = np.repeat(rows * s + offset, lengths) + within
    out["input_ids"].reshape(-1)[dst_tok] = store.tokens[src_tok]
    out["segment_ids"].reshape(-1)[dst_tok] = store.segments[src_tok]
    out["position_ids"].reshape(-1)[dst_tok] = within
    out["sequence_ids"].reshape(-1)[dst_tok] = np.repeat(slots + 1, lengths)

    src_mlm = _ranges(store.mlm_offsets[where], predictions)
    within_mlm = np.arange(src_mlm.size) - np.repeat(mlm_start, predictions)
    dst_mlm = np.repeat(rows * m + slot0, predictions) + within_mlm
    out["masked_lm_positions"].reshape(-1)[dst_mlm] = store.mlm_positions[src_mlm] + np.repeat(
        offset, predictions
    )
    out["masked_lm_ids"].reshape(-1)[dst_mlm] = store.mlm_ids[src_mlm]
    out["masked_lm_weights"].reshape(-1)[dst_mlm] = np.repeat(slots + 1, predictions)

    out["next_sentence_positions"][rows, slots] = offset
    out["next_sentence_labels"][rows, slots] = store.next_sentence_labels[where]
    out["next_sentence_weights"][rows, slots] = 1
    out["source_index"][rows, slots] = sources
    return out


class PackError(ValueError):
    """A packed row that breaks the format (found by `extract`); `row` is its index in the block."""

    def __init__(self, row: int, message: str):
        super().__init__(f"row {row}: {message}")
        self.row = int(row)


def extract(packs: dict) -> SequenceStore:
    """Packed rows -> the compact sequences they hold, in (row, slot) order.

    Checks the structure it relies on: present slots carry a run of their sequence id
    starting at next_sentence_positions, position_ids count from 0, masked slots point
    inside their own sequence. Raises PackError naming the row otherwise.
    """
    seq_ids = packs["sequence_ids"].astype(np.int64)
    p, s = seq_ids.shape
    k = packs["next_sentence_weights"].shape[1]
    present = packs["next_sentence_weights"] != 0
    rows, slots = np.nonzero(present)
    if seq_ids.size and seq_ids.max() > k:
        raise PackError(int(np.nonzero(seq_ids > k)[0][0]), f"a sequence id exceeds K={k}")
    key = (np.arange(p)[:, None] * (k + 1) + seq_ids).reshape(-1)
    counts = np.bincount(key, minlength=p * (k + 1)).reshape(p, k + 1)
    lengths = counts[rows, slots + 1]
    starts = packs["next_sentence_positions"][rows, slots].astype(np.int64)
    idx = _ranges(rows * s + starts, lengths)
    if idx.size and (idx.max() >= p * s or (idx - np.repeat(rows * s, lengths)).max() >= s):
        raise PackError(int(rows[0]), "a sequence runs past the end of the pack")
    run_ok = seq_ids.reshape(-1)[idx] == np.repeat(slots + 1, lengths)
    pos_ok = packs["position_ids"].reshape(-1)[idx] == np.arange(idx.size) - np.repeat(
        _starts(lengths), lengths
    )
    if not (run_ok.all() and pos_ok.all()):
        bad = np.repeat(rows, lengths)[~(run_ok & pos_ok)][0]
        raise PackError(int(bad), "sequence_ids/position_ids do not match next_sentence_positions")
    if ((counts[:, 1:] > 0) & ~present).any():
        raise PackError(int(np.nonzero((counts[:, 1:] > 0) & ~present)[0][0]), "tokens of an absent slot")
    weights = packs["masked_lm_weights"].astype(np.int64)
    mrows, mslots = np.nonzero(weights)
    mseq = weights[mrows, mslots] - 1
    if (mseq >= k).any():
        raise PackError(int(mrows[mseq >= k][0]), f"masked_lm_weights name a slot beyond K={k}")
    # order masked slots by (row, sequence slot, position in the row) to group them per sequence
    order = np.lexsort((mslots, mseq, mrows))
    mrows, mslots, mseq = mrows[order], mslots[order], mseq[order]
    rel = packs["masked_lm_positions"][mrows, mslots].astype(np.int64) - packs["next_sentence_positions"][
        mrows, mseq
    ].astype(np.int64)
    seq_len = counts[mrows, mseq + 1]
    if ((rel < 0) | (rel >= seq_len)).any():
        raise PackError(
            int(mrows[(rel < 0) | (rel >= seq_len)][0]), "a masked position lies outside its sequence"
        )
    predictions = np.bincount(mrows * k + mseq, minlength=p * k).reshape(p, k)
    return SequenceStore(
        tokens=packs["input_ids"].reshape(-1)[idx],
        segments=packs["segment_ids"].reshape(-1)[idx],
        lengths=lengths,
        mlm_positions=rel,
        mlm_ids=packs["masked_lm_ids"][mrows, mslots],
        predictions=predictions[rows, slots],
        next_sentence_labels=packs["next_sentence_labels"][rows, slots],
        source_index=packs["source_index"][rows, slots].astype(np.int64),
    )


def create_shard_datasets(f, packs: int, s: int, k: int, m: int, vocab_size: int) -> dict:
    """Empty fields of one shard in an open h5py file, filled block by block by the caller.

    Contiguous datasets, no timestamps: the same data gives the same bytes."""
    f.attrs["format"] = FORMAT_NAME
    f.attrs["format_version"] = FORMAT_VERSION
    sizes = {"S": s, "K": k, "M": m}
    dtypes = field_dtypes(vocab_size)
    return {
        name: f.create_dataset(name, shape=(packs, sizes[dim]), dtype=dtypes[name], track_times=False)
        for name, (dim, _) in PACKED_FIELDS.items()
    }


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedDataset:
    """A packed directory: metadata.json plus its shards, checked on open."""

    folder: Path
    metadata: dict

    @classmethod
    def open(cls, folder) -> PackedDataset:
        folder = Path(folder)
        if not folder.is_dir():
            raise PackingInputError(f"packed data directory {folder} does not exist")
        meta_path = folder / METADATA
        if not meta_path.is_file():
            raise PackingInputError(
                f"{meta_path} is missing: {folder} is not a finished packed dataset (run `python -m packed_transformers.packing pack`)"
            )
        try:
            metadata = json.loads(meta_path.read_text())
        except json.JSONDecodeError as err:
            raise PackingInputError(f"{meta_path}: not valid JSON ({err})") from None
        if metadata.get("format") != FORMAT_NAME or metadata.get("format_version") != FORMAT_VERSION:
            raise PackingInputError(
                f"{meta_path}: format {metadata.get('format')!r} version {metadata.get('format_version')!r}, "
                f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
            )
        for key in ("S", "K", "M", "sequences", "packs", "shards"):
            if key not in metadata:
                raise PackingInputError(f"{meta_path}: field '{key}' is missing")
        for key in ("S", "K", "M", "sequences", "packs"):
            value = metadata[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PackingInputError(f"{meta_path}: field '{key}' must be an integer >= 0, got {value!r}")
        vocab = metadata.get("vocab_size")
        if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
            raise PackingInputError(
                f"{meta_path}: field 'vocab_size' must be an integer >= 1 or null, got {vocab!r}"
            )
        if not isinstance(metadata["shards"], list):
            raise PackingInputError(f"{meta_path}: field 'shards' must be a list")
        check_shard_records(folder, metadata)
        return cls(folder, metadata)

    @property
    def shards(self) -> list[dict]:
        return self.metadata["shards"]

    def check_contents(self, sha256: bool) -> None:
        """Every shard's size, rows and field widths against metadata.json (opening each
        file), and with `sha256` its digest (reading every byte). PackingInputError naming
        the shard and what differs."""
        import h5py

        widths = {"S": self.metadata["S"], "K": self.metadata["K"], "M": self.metadata["M"]}
        for record in self.shards:
            path = self.folder / record["name"]
            if path.stat().st_size != record["bytes"]:
                raise PackingInputError(
                    f"{path}: {path.stat().st_size} bytes, {METADATA} says {record['bytes']} (truncated or replaced)"
                )
            try:
                with h5py.File(path, "r") as f:
                    for name, (dim, _) in PACKED_FIELDS.items():
                        if name not in f:
                            raise PackingInputError(f"{path}: field '{name}' is missing")
                        problem = field_type_problem(f[name], name, self.metadata.get("vocab_size"))
                        if problem:
                            raise PackingInputError(f"{path}: field '{name}' {problem}")
                        shape = f[name].shape
                        if shape[0] != record["packs"]:
                            raise PackingInputError(
                                f"{path}: '{name}' has {shape[0]} rows, {METADATA} says {record['packs']} packs"
                            )
                        if f[name].external:  # read at step 1 from elsewhere: not our format
                            raise PackingInputError(
                                f"{path}: '{name}' keeps its data in external files; a shard holds its data itself"
                            )
                        width = widths[dim]
                        if len(shape) != 2 or shape[1] != width:
                            raise PackingInputError(
                                f"{path}: '{name}' has shape {shape}, expected [packs, {width}] from {METADATA}"
                            )
            except OSError as err:
                raise PackingInputError(f"{path}: not a readable HDF5 shard ({err})") from None
            if sha256 and sha256_file(path) != record.get("sha256"):
                raise PackingInputError(
                    f"{path}: sha256 differs from {METADATA} (the file changed after packing)"
                )

    @property
    def packs(self) -> int:
        return int(self.metadata["packs"])

    @property
    def sequences(self) -> int:
        return int(self.metadata["sequences"])

    def shard_path(self, i: int) -> Path:
        return self.folder / self.shards[i]["name"]

    def blocks(self, shard: int, packs_per_block: int = 1 << 13):
        """Yield (first pack index, packs) over one shard, a block of packs at a time."""
        import h5py

        with h5py.File(self.shard_path(shard), "r") as handle:
            total = handle["input_ids"].shape[0]
            for start in range(0, total, packs_per_block):
                yield start, self.read(shard, start, min(total, start + packs_per_block), handle)

    def read(self, shard: int, start: int, stop: int, handle=None) -> dict:
        """Packs [start, stop) of one shard: dict of numpy arrays."""
        import h5py

        path = self.shard_path(shard)
        try:
            f = handle if handle is not None else h5py.File(path, "r")
            try:
                return {name: f[name][start:stop] for name in PACKED_FIELDS}
            finally:
                if handle is None:
                    f.close()
        except (OSError, KeyError) as err:
            raise PackingInputError(f"{path}: packs {start}..{stop - 1} cannot be read ({err})") from None


def field_type_problem(node, name: str, vocab_size) -> str | None:
    """What makes an HDF5 node unfit to be packed field `name`, or None: it must be a dataset
    of integers that holds every value the format's dtype holds (a uint16 field may be
    stored wider, never narrower: int8 ids over 127 would wrap negative), and a signed one
    must hold no negative value (ids, positions and labels are >= 0; source_index -1 marks
    an empty slot). Floats (which would be truncated) and byte strings are refused."""
    import h5py

    if not isinstance(node, h5py.Dataset):
        return f"is a {type(node).__name__.lower()}, expected a dataset"
    dtype = node.dtype
    expected = np.dtype(field_dtypes(vocab_size or BERT_VOCAB_SIZE)[name])
    if dtype.kind not in "iu" or not np.can_cast(expected, dtype, "safe"):
        return f"has dtype {dtype}, expected integers holding {expected} (the packed format's)"
    if dtype.kind == "i" and name != "source_index" and node.size:
        rows = node.shape[0]
        step = max(1, (1 << 24) // max(1, node.size // max(1, rows)))  # ~16M values a block
        for start in range(0, rows, step):
            block = node[start : start + step]
            if block.size and block.min() < 0:
                row = start + int(np.argwhere(block < 0)[0][0])
                return f"holds a negative value at row {row}; the packed format's values are >= 0"
    return None


def check_shard_records(folder: Path, metadata: dict) -> None:
    """metadata.json's shard list, checked without reading shard contents: every name a
    plain file name inside the folder, every file present, and the totals (packs,
    sequences, packing factor) equal to what the shard records add up to. Counts are
    derived and compared, never trusted. (Sizes and contents: `check_contents`, which
    training runs; verify compares contents and sha256 itself and reports them.)"""
    meta_path = folder / METADATA
    packs = sequences = 0
    for i, record in enumerate(metadata["shards"]):
        name = record.get("name") if isinstance(record, dict) else None
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise PackingInputError(
                f"{meta_path}: shards[{i}].name {name!r} must be a plain file name inside {folder}"
            )
        path = folder / name
        if not path.is_file():
            what = not_a_file(path)  # a FIFO or device stands there: not "missing"
            if what is not None:
                raise PackingInputError(f"{path} is listed in {METADATA} but is {what}, not a shard file")
            raise PackingInputError(f"{path} is listed in {METADATA} but missing")
        for key in ("packs", "sequences", "bytes"):
            if not isinstance(record.get(key), int) or record[key] < 0:
                raise PackingInputError(f"{meta_path}: shards[{i}].{key} must be an integer >= 0")
        packs += record["packs"]
        sequences += record["sequences"]
    if metadata["packs"] != packs or metadata["sequences"] != sequences:
        raise PackingInputError(
            f"{meta_path}: packs {metadata['packs']} / sequences {metadata['sequences']}, but the shards "
            f"hold {packs} / {sequences}"
        )
    factor = metadata.get("packing_factor")
    if (
        packs
        and isinstance(factor, (int, float))
        and abs(factor - sequences / packs) > 1e-9 * max(1.0, factor)
    ):
        raise PackingInputError(
            f"{meta_path}: packing_factor {factor}, but the shards hold {sequences} sequences in {packs} packs"
        )
