"""Packed shards built to break the reader: every hostile pack named by the structure check,
ids varlen attention cannot compute exactly, a shard changed under the reader, manifests that
list nothing, metadata and field dtypes checked at open."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ..training_helpers import make_packed, run, write_config


def _block(packed, shard=0):
    from packed_transformers.packing.shards import PackedDataset

    return PackedDataset.open(packed / "train").read(shard, 0, 40)


def _hostile(kind: str, fields: dict) -> None:
    """One pack (row 7) made hostile in a way metadata cannot show (#8)."""
    ids, row = fields["sequence_ids"], 7
    n = int((ids[row] > 0).sum())
    if kind == "id above K":
        ids[row, :n][ids[row, :n] == ids[row, :n].max()] = 9
    elif kind == "hole":
        ids[row, 1] = 0
    elif kind == "non-contiguous":  # runs 1 and 2 interleaved, each still counted right
        first = int((ids[row] == 1).sum())
        ids[row, first - 1], ids[row, first] = ids[row, first], ids[row, first - 1]
    elif kind == "positions":
        fields["position_ids"][row, 2] += 1
    elif kind == "cls":
        fields["next_sentence_positions"][row, 0] = 3
    elif kind == "vocabulary":
        fields["input_ids"][row, 1] = 1300


HOSTILE = {
    "id above K": "above K=3",
    "hole": "padding before a real token",
    "non-contiguous": "not contiguous",
    "positions": "position_ids",
    "cls": "next_sentence_positions",
    "vocabulary": "model.vocab_size 1200",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_every_hostile_pack_is_named_by_the_structure_check(tmp_path, kind):
    """#8 and #4: each rule of the format, checked on a whole block at once."""
    from packed_transformers.packs.structure import first_malformed

    (tmp_path / "data").mkdir()
    fields = _block(make_packed(tmp_path / "data"))
    assert first_malformed(fields, 1200, 2) is None
    _hostile(kind, fields)
    row, what = first_malformed(fields, 1200, 2)
    assert row == 7 and HOSTILE[kind] in what


def test_varlen_refuses_ids_its_layout_cannot_compute_exactly():
    """#8: non-contiguous runs trained silently with attention unlike dense's; an id above K
    crashed in scatter_add. The block-diagonal path (exact for any ids) is unaffected."""
    import torch

    from packed_transformers.model.varlen import varlen_layout

    good = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 3, 0, 0, 0]])
    varlen_layout(good, 3, flash=False, granularity=8)
    for ids in ([[1, 2, 1, 2, 0, 0]], [[1, 1, 4, 0, 0, 0]], [[1, 0, 2, 2, 0, 0]], [[2, 2, 0, 0, 0, 0]]):
        with pytest.raises(ValueError, match="contiguous runs"):
            varlen_layout(torch.tensor(ids), 3, flash=False, granularity=8)
    varlen_layout(torch.tensor([[1, 2, 1, 2, 0, 0]]), 3, flash=False)  # block-diagonal: exact


def _rewrite_pack_in_place(shard, kind):
    """Change one pack inside the HDF5 file (same size) and keep metadata.json consistent
    with it (new sha256): the hostile pack of #8, which every file-level check passes."""
    import h5py

    from packed_transformers.common.files import sha256_file

    with h5py.File(shard, "r+") as f:
        fields = {name: f[name][:] for name in f}
        _hostile(kind, fields)
        for name in f:
            f[name][...] = fields[name]
    meta_path = shard.parent / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for record in meta["shards"]:
        if record["name"] == shard.name:
            assert record["bytes"] == shard.stat().st_size
            record["sha256"] = sha256_file(shard)
    meta_path.write_text(json.dumps(meta))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_hostile_pack_stops_training_with_one_line_naming_shard_and_pack(tmp_path, workers):
    """#8 and #4: with consistent metadata, a non-contiguous pack trained silently and a
    token id beyond the vocabulary was an IndexError mid-step; the reader now refuses
    both, in the process or in a DataLoader worker, naming the shard and the pack."""
    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    shards = sorted((packed / "train").glob("part-*.h5"))
    _rewrite_pack_in_place(shards[0], "non-contiguous")
    _rewrite_pack_in_place(shards[-1], "vocabulary")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 40},
                          data={"loader_workers": workers})  # fmt: skip
    done = run(config, tmp_path / "run")
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "part-" in error[0] and "pack 7" in error[0], error[0]


def test_a_shard_changed_under_the_reader_is_reported_not_a_sigbus(tmp_path):
    """#7: a shard truncated under the memory map killed the job with SIGBUS (exit 135, no
    message); one copied over in place was read silently as new bytes."""
    import shutil

    from packed_transformers.components.data import PackedShards, ShardReadError
    from packed_transformers.packing.shards import PackedDataset

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    dataset = PackedDataset.open(packed / "train")
    reader = PackedShards(dataset, 1200, 2)
    reader[[0, 1, 2]]
    shard = dataset.shard_path(0)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(ShardReadError, match="changed while the job was reading it"):
        reader[[0, 1, 2]]
    # the same bytes copied over the file in place: same size, a new write
    reader = PackedShards(PackedDataset.open(packed / "eval"), 1200, 2)
    reader[[0]]
    eval_shard = packed / "eval" / "part-00000.h5"
    copy = tmp_path / "copy.h5"
    shutil.copy(eval_shard, copy)
    os.utime(copy, ns=(1, 1))
    with open(copy, "rb") as src, open(eval_shard, "r+b") as dst:
        dst.write(src.read())
    with pytest.raises(ShardReadError, match="changed"):
        reader[[0]]


def test_a_manifest_that_lists_nothing_proves_nothing(tmp_path):
    """#14: a manifest without 'files' was a KeyError, one with {} was accepted as intact."""
    from packed_transformers.components.checkpoint import CheckpointError, check_checkpoint

    checkpoint = tmp_path / "step-00000002"
    (checkpoint / "model").mkdir(parents=True)
    for manifest, match in (({"step": 2}, "'files' must list"), ({"step": 2, "files": {}}, "'files' must list"),
                            ([], "'files' must list")):  # fmt: skip
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=match):
            check_checkpoint(checkpoint)
    names = ["model/model.safetensors", "model/config.json", "training_state.pt"]
    for name in names:
        (checkpoint / name).write_text("x")
    (checkpoint / "manifest.json").write_text(json.dumps({"files": {name: {"bytes": "1"} for name in names}}))
    with pytest.raises(CheckpointError, match="must hold 'bytes' and 'sha256'"):
        check_checkpoint(checkpoint)


def test_metadata_with_a_string_vocab_size_or_an_external_shard_is_refused_at_open(tmp_path):
    """#14: metadata vocab_size "30522" was a TypeError later; a shard keeping a field in
    external files failed at step 1, after config.yaml was written."""
    import h5py

    from packed_transformers.common.files import sha256_file
    from packed_transformers.packing.shards import PackedDataset
    from packed_transformers.packs.errors import PackingInputError

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data") / "train"
    meta = json.loads((packed / "metadata.json").read_text())
    (packed / "metadata.json").write_text(json.dumps({**meta, "vocab_size": "1200"}))
    with pytest.raises(PackingInputError, match="'vocab_size' must be an integer"):
        PackedDataset.open(packed)
    (packed / "metadata.json").write_text(json.dumps(meta))
    shard = packed / meta["shards"][0]["name"]
    with h5py.File(shard) as f:
        fields = {name: f[name][:] for name in f}
    shard.unlink()
    with h5py.File(shard, "w") as f:
        for name, values in fields.items():
            if name == "input_ids":
                values.tofile(tmp_path / "ids.bin")
                f.create_dataset(name, values.shape, values.dtype,
                                 external=[(str(tmp_path / "ids.bin"), 0, values.nbytes)])  # fmt: skip
            else:
                f.create_dataset(name, data=values)
    meta["shards"][0].update(bytes=shard.stat().st_size, sha256=sha256_file(shard))  # consistent metadata
    (packed / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(PackingInputError, match="external files"):
        PackedDataset.open(packed).check_contents(sha256=False)


# ----- 9. packed shards of other dtypes: one line naming shard and field ---------------------------
def rewrite_shard(packed, change):
    """Shard 0 rewritten with `change(fields)` applied (metadata kept consistent)."""
    import h5py

    from packed_transformers.common.files import sha256_file

    meta = json.loads((packed / "metadata.json").read_text())
    shard = packed / meta["shards"][0]["name"]
    with h5py.File(shard) as f:
        fields = {name: f[name][:] for name in f}
    shard.unlink()
    with h5py.File(shard, "w") as f:
        for name, values in change(fields).items():
            if values is None:
                f.create_group(name)
            else:
                f.create_dataset(name, data=values)
    meta["shards"][0].update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
    (packed / "metadata.json").write_text(json.dumps(meta))
    return shard


@pytest.mark.parametrize(
    "name, change, expected",
    [
        ("int8_ids", lambda f: {**f, "input_ids": f["input_ids"].astype(np.int8)},
         "field 'input_ids' has dtype int8, expected integers holding uint16"),
        ("bytes_segments", lambda f: {**f, "segment_ids": f["segment_ids"].astype("S1")},
         "field 'segment_ids' has dtype |S1, expected integers holding uint8"),
        ("group", lambda f: {**f, "sequence_ids": None}, "field 'sequence_ids' is a group, expected a dataset"),
        ("float_ids", lambda f: {**f, "input_ids": f["input_ids"] + 0.5},
         "field 'input_ids' has dtype float64, expected integers"),
        ("negative_ids", lambda f: {**f, "input_ids": np.where(np.arange(f["input_ids"].shape[1]) == 3, -5,
                                                               f["input_ids"].astype(np.int32))},
         "field 'input_ids' holds a negative value at row 0"),
        ("wider_is_fine", lambda f: {**f, "input_ids": f["input_ids"].astype(np.int64)}, None),
    ],
)  # fmt: skip
def test_each_field_dtype_is_checked_when_a_shard_is_opened(tmp_path, name, change, expected):
    from packed_transformers.packing.shards import PackedDataset
    from packed_transformers.packs.errors import PackingInputError

    from ..training_helpers import make_packed

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data") / "train"
    shard = rewrite_shard(packed, change)
    if expected is None:
        PackedDataset.open(packed).check_contents(sha256=True)
        return
    with pytest.raises(PackingInputError) as caught:
        PackedDataset.open(packed).check_contents(sha256=False)
    assert str(caught.value).startswith(f"{shard}: ") and expected in str(caught.value)


# ----- 10. pretraining --resume on a checkpoint whose manifest matches damaged weights --------------
