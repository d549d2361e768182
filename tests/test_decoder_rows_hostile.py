"""Decoder pretraining's rows and config held to docs/failure_behaviour.md (issue 83): rows
that break the pack format with consistent metadata (sha256 updated), counts the rows do not
hold, headers that claim more than the file, a micro-batch larger than the data, a
vocabulary below the rows', a model that cannot fit, and checkpoint temporaries left by a
killed save. Each is refused in one line before any compute and before a run folder is
written, or (the temporaries) cleaned at resume."""

from __future__ import annotations

import json
import tracemalloc

import h5py
import numpy as np
import pytest

from packed_transformers.common.files import sha256_file
from packed_transformers.packing.errors import PackingInputError
from packed_transformers.packing.lm_rows.row_rule import first_malformed_row
from packed_transformers.packing.lm_rows.store import RowStore

from .training_helpers import DECODER_VOCAB as VOCAB
from .training_helpers import decoder_rows, pretrain_decoder


def write_folder(folder, lengths=(5, 9, 30, 3, 12, 40, 7, 7, 20, 11) * 4, seed=0):
    return decoder_rows(folder, lengths, seed)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("rows") / "train")


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
def test_rows_that_break_the_format_are_refused_at_open_naming_file_and_row(clean, tmp_path, case):
    edit, expected = CASES[case]
    folder = tamper(clean, tmp_path / "rows", edit)
    with pytest.raises(PackingInputError, match=expected) as err:
        RowStore.open(folder)
    message = str(err.value)
    assert "part-00000.h5: row " in message and "\n" not in message


def test_the_clean_rows_open_and_the_rule_finds_nothing(clean):
    store = RowStore.open(clean)
    fields = {name: store.fields[name] for name in store.fields}
    assert first_malformed_row(fields, store.metadata["K"], VOCAB, 40, "documents") is None
    assert store.batch(np.arange(3))["input_ids"].dtype == np.int64
    assert store.fields["input_ids"].dtype == np.uint16  # kept in its stored dtype


def test_rows_of_padding_with_a_real_token_count_claimed_are_refused(clean, tmp_path):
    folder = tamper(clean, tmp_path / "rows", all_padding, recount=False)  # metadata keeps its count
    with pytest.raises(PackingInputError, match="no real token at its start"):
        RowStore.open(folder)


def test_a_real_token_count_the_rows_do_not_hold_is_refused(clean, tmp_path):
    folder = tamper(
        clean, tmp_path / "rows", lambda f: None, lambda m: m.update(real_tokens=m["real_tokens"] + 1)
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


# ----- the run ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_root(tmp_path_factory, clean):
    root = clean.parent
    write_folder(root / "eval", lengths=(8, 20, 31, 4) * 3, seed=1)
    return root


def pretrain(root, output, *sets, resume=False):
    return pretrain_decoder(root, output, *sets, resume=resume)


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("data.micro_batch_rows=100000", "100000 rows a step: data.train_dir holds"),
        ("model.vocab_size=10", "model.vocab_size 10: below the rows' vocabulary of 50 tokens"),
        ("model.vocab_size=99999999", "parameters (vocab_size 99999999) need"),
    ],
)
def test_a_key_the_data_or_the_machine_cannot_hold_is_refused_before_the_run_folder(
    data_root, tmp_path, setting, expected
):
    done = pretrain(data_root, tmp_path / "run", setting)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert expected in lines[-1] and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_temporary_left_by_a_killed_save_is_removed_at_resume(data_root, tmp_path):
    first = pretrain(data_root, tmp_path / "run", "training.checkpoint_every_steps=1")
    assert first.returncode == 0, first.stderr[-2000:]
    leftover = tmp_path / "run/checkpoints/.step-00000003.tmp-99999-abcd"
    leftover.mkdir()
    (leftover / "training_state.pt").write_bytes(b"half")
    again = pretrain(data_root, tmp_path / "run", "training.checkpoint_every_steps=1", "training.max_steps=3",
                     resume=True)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert not leftover.exists()
    names = sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir())
    assert all(not n.startswith(".") for n in names), names


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line(tmp_path):
    """A full disk at the checkpoint (RLIMIT_FSIZE below its size, SIGXFSZ ignored: the write
    fails as on a full disk): one line naming the checkpoint, exit 2, no half-written folder
    (it was the project's own CheckpointError as a 27-line traceback, exit 1)."""
    import resource
    import signal
    import subprocess
    import sys

    from .conftest import REPO
    from .training_helpers import DECODER_S

    decoder_rows(tmp_path / "train")
    decoder_rows(tmp_path / "eval", seed=1)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (20_000, 20_000)
        )  # the weights fit, the optimizer's state not

    sets = [f"data.train_dir={tmp_path / 'train'}", f"data.eval_dir={tmp_path / 'eval'}",
            f"data.max_sequence_length={DECODER_S}", "eval.rows=2", "model.hidden_size=16",
            "model.intermediate_size=32", "model.num_hidden_layers=1", "training.max_steps=2"]  # fmt: skip
    output = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "run_pretraining.py", "--config", "configs/pretrain_decoder_tiny.yaml", "--output-dir",
         str(output), *[a for s in sets for a in ("--set", s)]],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=small_files,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and f"{output}/checkpoints/step-00000002: writing the checkpoint failed" in errors[0]
    )
    assert list((output / "checkpoints").iterdir()) == []  # nothing half-written


def test_a_bert_folder_as_the_starting_checkpoint_is_named_as_such(tmp_path):
    """It was `cannot be loaded (...: the model's head is not in the file (..., cls.predictions.
    transform.LayerNorm.bi)`, cut mid-word; now the folder's model_type is named, before any
    run folder is written."""
    from packed_transformers.data.assets import model_dir

    root = tmp_path / "rows"
    decoder_rows(root / "train")
    decoder_rows(root / "eval", seed=1)
    done = pretrain_decoder(root, tmp_path / "out", f"model.init_checkpoint={model_dir()}")
    assert done.returncode == 2
    assert (
        f"model.init_checkpoint {model_dir()}: its config.json says model_type 'bert', not a decoder family"
        in done.stderr
    )
    assert not (tmp_path / "out").exists()
