"""Decoder rows files that break the format or claim what they do not hold: refused at open,
naming file and row, before anything large is read."""

from __future__ import annotations

import json
import tracemalloc

import h5py
import numpy as np
import pytest

from packed_transformers.common.files import sha256_file
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.lm_rows.row_rule import first_malformed_row
from packed_transformers.packs.lm_rows.store import RowStore

from ..training_helpers import DECODER_VOCAB as VOCAB


def tamper(source, target, edit, meta_edit=None, recount=True):
    """A copy of `source` whose shard `edit(fields)` changed in place, its sha256 (and, with
    recount, its real-token count) updated: metadata consistent with the edited rows."""
    import shutil

    shutil.copytree(source, target)
    shard = target / "part-00000.h5"
    with h5py.File(shard, "r+") as f:
        fields = {name: f[name][()].astype(np.int64) for name in f}
        edit(fields)
        for name, values in fields.items():
            f[name][...] = values
        real = int((fields["sequence_ids"] > 0).sum())
    meta = json.loads((target / "metadata.json").read_text())
    meta["shards"][0]["sha256"] = sha256_file(shard)
    if recount:
        meta["real_tokens"] = real
    if meta_edit:
        meta_edit(meta)
    (target / "metadata.json").write_text(json.dumps(meta))
    return target


def first_row_with_segments(fields, count):
    return int(np.flatnonzero(fields["sequence_ids"].max(axis=1) >= count)[0])


def hole(f):
    r = int(np.flatnonzero((f["sequence_ids"] > 0).sum(1) > 4)[0])
    f["sequence_ids"][r, 2], f["document_ids"][r, 2] = 0, -1


def id_above_k(f):
    r = first_row_with_segments(f, 1)
    last = int(np.flatnonzero(f["sequence_ids"][r] > 0)[-1])
    f["sequence_ids"][r, last] = f["sequence_ids"].max() + 200


def jump(f):
    r = int(np.flatnonzero((f["sequence_ids"] > 0).sum(1) > 4)[0])
    segment = f["sequence_ids"][r] == f["sequence_ids"][r, 0]
    if segment.sum() < 3:
        pytest.skip("no segment of 3 tokens")
    f["position_ids"][r, 2:][segment[2:]] += 5


def non_contiguous(f):
    r = first_row_with_segments(f, 2)
    seq = f["sequence_ids"][r]
    last = int(np.flatnonzero(seq > 0)[-1])
    seq[last] = 1  # the first segment comes back after the second


def huge_document(f):
    real = f["sequence_ids"] > 0
    f["document_ids"][real] = 10**9


def all_padding(f):
    for name in f:
        f[name][...] = 0
    f["document_ids"][...] = -1


CASES = {
    "a padding hole inside a document": (hole, "a real token after padding"),
    "a sequence id above K": (id_above_k, "a sequence id outside 0.."),
    "positions jumping mid-document": (jump, "positions that jump inside a segment"),
    "non-contiguous runs": (non_contiguous, "segments that are not contiguous runs"),
    "document ids of 10^9": (huge_document, "a document id outside 0..39"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_that_break_the_format_are_refused_at_open_naming_file_and_row(
    decoder_train_rows, tmp_path, case
):
    edit, expected = CASES[case]
    folder = tamper(decoder_train_rows, tmp_path / "rows", edit)
    with pytest.raises(PackingInputError, match=expected) as err:
        RowStore.open(folder)
    message = str(err.value)
    assert "part-00000.h5: row " in message and "\n" not in message


def test_the_clean_rows_open_and_the_rule_finds_nothing(decoder_train_rows):
    store = RowStore.open(decoder_train_rows)
    fields = {name: store.fields[name] for name in store.fields}
    assert first_malformed_row(fields, store.metadata["K"], VOCAB, 40, "documents") is None
    assert store.batch(np.arange(3))["input_ids"].dtype == np.int64
    assert store.fields["input_ids"].dtype == np.uint16  # kept in its stored dtype


def test_rows_of_padding_with_a_real_token_count_claimed_are_refused(decoder_train_rows, tmp_path):
    folder = tamper(
        decoder_train_rows, tmp_path / "rows", all_padding, recount=False
    )  # metadata keeps its count
    with pytest.raises(PackingInputError, match="no real token at its start"):
        RowStore.open(folder)


def test_a_real_token_count_the_rows_do_not_hold_is_refused(decoder_train_rows, tmp_path):
    folder = tamper(
        decoder_train_rows,
        tmp_path / "rows",
        lambda f: None,
        lambda m: m.update(real_tokens=m["real_tokens"] + 1),
    )
    with pytest.raises(PackingInputError, match=r"real_tokens \d+ but the rows hold \d+"):
        RowStore.open(folder)


def claiming_shard(folder, rows, length=8192):
    """A tiny HDF5 file whose fields declare [rows, length] (gzip, fill value, nothing
    written), described by a consistent metadata.json."""
    folder.mkdir()
    with h5py.File(folder / "part-00000.h5", "w") as f:
        for name in ("input_ids", "sequence_ids", "position_ids", "document_ids", "document_offsets"):
            f.create_dataset(
                name, shape=(rows, length), dtype=np.int32, compression="gzip", chunks=(64, length)
            )
    meta = {"format": "packed-lm-rows", "version": 1, "layout": "documents", "S": length, "K": 16,
            "rows": rows, "real_tokens": rows * length, "vocab_size": 300, "eos_id": 0,
            "shards": [{"file": "part-00000.h5", "rows": rows, "sha256": sha256_file(folder / "part-00000.h5")}]}  # fmt: skip
    (folder / "metadata.json").write_text(json.dumps(meta))
    return folder


def test_a_header_claiming_a_huge_field_costs_what_is_read_not_what_it_claims(tmp_path):
    folder = claiming_shard(tmp_path / "claims", 131_072)
    assert (folder / "part-00000.h5").stat().st_size < 200_000
    tracemalloc.start()
    try:
        with pytest.raises(PackingInputError, match="row 0 .*no real token"):
            RowStore.open(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, peak  # the field claims 4 GiB in int32 (20 GiB as int64 x 5)


def test_metadata_claiming_more_rows_than_the_header_is_refused_before_reading(tmp_path):
    folder = claiming_shard(tmp_path / "claims", 64)
    meta = json.loads((folder / "metadata.json").read_text())
    meta["rows"] = meta["shards"][0]["rows"] = 10**6
    (folder / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(
        PackingInputError, match=r"field input_ids is int32 \(64, 8192\), expected .*\[1000000, 8192\]"
    ):
        RowStore.open(folder)
    meta["rows"] = 10**6 + 1
    (folder / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(PackingInputError, match="rows 1000001 but the shards' rows add up to 1000000"):
        RowStore.open(folder)
