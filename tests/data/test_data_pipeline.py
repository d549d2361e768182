"""Pack / verify / unpack pipeline: round trips, determinism, planted faults, bad input, resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_transformers.data.synthetic import synthetic_rows, write_synthetic_shards
from packed_transformers.packing import pipeline
from packed_transformers.packing.cli import main as packing_main
from packed_transformers.packing.shards import PackedDataset
from packed_transformers.packs.algorithms import pack
from packed_transformers.packs.histogram import Histogram
from packed_transformers.packs.plan import assign_sequences
from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

from ..conftest import REPO
from ..packing_helpers import P, S, small_counts  # noqa: F401


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unpacked")
    write_synthetic_shards(folder, small_counts(), sequences=3000, rows_per_file=1100, seed=7, p=P)
    return folder


def run_cli(*args) -> int:
    return packing_main([str(a) for a in args])


def pack_args(inputs, output, *extra):
    return (
        "pack",
        "--input",
        f"{inputs}/*.h5",
        "--output",
        output,
        "--max-sequence-length",
        S,
        "--max-predictions-per-seq",
        P,
        "--shard-size",
        400,
        "--quiet",
        *extra,
    )


def test_pack_unpack_round_trip_is_exact(inputs, tmp_path):
    assert run_cli(*pack_args(inputs, tmp_path / "packed", "--workers", 2, "--algorithm", "lpfhp")) == 0
    meta = json.loads((tmp_path / "packed" / "metadata.json").read_text())
    assert (
        meta["sequences"] == 3000 and meta["packs"] < 3000 and len(meta["shards"]) == -(-meta["packs"] // 400)
    )
    assert not (tmp_path / "packed" / ".work").exists()
    assert run_cli("unpack", "--packed", tmp_path / "packed", "--output", tmp_path / "unpacked") == 0
    for original in sorted(inputs.glob("*.h5")):
        with h5py.File(original) as a, h5py.File(tmp_path / "unpacked" / original.name) as b:
            for name in a:
                assert a[name].dtype == b[name].dtype, name
                np.testing.assert_array_equal(a[name][:], b[name][:], err_msg=name)


@pytest.mark.parametrize("algorithm,k", [("none", "1"), ("spfhp", "3"), ("lp", "max")])
def test_pack_then_verify_passes_for_each_algorithm(inputs, tmp_path, algorithm, k, capsys):
    out = tmp_path / "packed"
    assert run_cli(*pack_args(inputs, out, "--algorithm", algorithm, "--max-sequences-per-pack", k)) == 0
    data = PackedDataset.open(out)
    if algorithm == "none":
        assert data.metadata["K"] == 1 and data.packs == 3000
    capsys.readouterr()
    assert run_cli("verify", "--input", f"{inputs}/*.h5", "--packed", out, "--quiet") == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    assert report["exactly_once"] == 3000 and report["ok"]


def test_same_seed_gives_byte_identical_shards(inputs, tmp_path):
    for name, seed, workers in (("a", 1, 1), ("b", 1, 2), ("c", 2, 2)):
        assert run_cli(*pack_args(inputs, tmp_path / name, "--seed", seed, "--workers", workers)) == 0
    shards = sorted(p.name for p in (tmp_path / "a").glob("part-*.h5"))
    assert len(shards) >= 3
    for shard in shards:
        assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    assert (tmp_path / "a" / shards[0]).read_bytes() != (tmp_path / "c" / shards[0]).read_bytes()
    with h5py.File(tmp_path / "a" / shards[0]) as f:
        sources = f["source_index"][:]
    assert not np.all(np.diff(sources[:, 0]) > 0), "packs must come in random order"


@pytest.fixture()
def packed_copy(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("planted") / "packed"
    assert run_cli(*pack_args(inputs, out)) == 0
    return out


def _edit_shard(folder, edit):
    path = folder / "part-00000.h5"
    with h5py.File(path) as f:
        data = {name: f[name][:] for name in f}
    edit(data)
    path.unlink()
    with h5py.File(path, "w") as f:
        for name, values in data.items():
            f.create_dataset(name, data=values)


def _verify(inputs, folder, capsys):
    capsys.readouterr()
    code = run_cli("verify", "--input", f"{inputs}/*.h5", "--packed", folder, "--quiet")
    lines = capsys.readouterr().out.splitlines()
    return code, json.loads(lines[0]), lines[1:]


def test_verify_catches_a_planted_duplicate(inputs, packed_copy, capsys):
    def duplicate(d):
        for name in d:
            d[name][1] = d[name][0]

    _edit_shard(packed_copy, duplicate)
    code, report, lines = _verify(inputs, packed_copy, capsys)
    assert code == 1 and report["duplicated"] >= 1 and report["missing"] >= 1
    assert any(line.startswith("MISMATCH duplicated") for line in lines)


def test_verify_catches_a_planted_missing_sequence(inputs, packed_copy, capsys):
    _edit_shard(packed_copy, lambda d: [d.__setitem__(name, d[name][:-1]) for name in list(d)])
    code, report, lines = _verify(inputs, packed_copy, capsys)
    assert code == 1 and report["missing"] >= 1 and report["duplicated"] == 0
    assert any("missing: sequence" in line and "row" in line for line in lines)


def test_verify_catches_a_planted_token_change(inputs, packed_copy, capsys):
    def change(d):
        d["input_ids"][3, 5] += 1

    _edit_shard(packed_copy, change)
    code, report, lines = _verify(inputs, packed_copy, capsys)
    assert code == 1 and report["changed"] == 1 and report["missing"] == 0 and report["duplicated"] == 0
    assert any("changed tokens" in line for line in lines)


def test_verify_catches_a_changed_nsp_label_and_masked_position(inputs, packed_copy, capsys):
    def change(d):
        d["next_sentence_labels"][2, 0] ^= 1
        d["masked_lm_ids"][4, 0] += 1

    _edit_shard(packed_copy, change)
    code, report, _ = _verify(inputs, packed_copy, capsys)
    assert code == 1 and report["changed"] == 2


def test_resume_after_a_crash_finishes_without_duplicates(inputs, tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    assert run_cli(*pack_args(inputs, clean, "--workers", 1)) == 0
    crashed = tmp_path / "crashed"
    real_write = pipeline._write_shard

    def crash_on_third(task):
        if task.shard == 2:
            raise KeyboardInterrupt("simulated crash")
        return real_write(task)

    monkeypatch.setattr(pipeline, "_write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_cli(*pack_args(inputs, crashed, "--workers", 1))
    assert not (crashed / "metadata.json").exists(), "an unfinished job must not look complete"
    assert (crashed / "part-00000.h5").exists() and not (crashed / "part-00002.h5").exists()
    monkeypatch.setattr(pipeline, "_write_shard", real_write)
    assert run_cli(*pack_args(inputs, crashed, "--workers", 1)) == 0
    for shard in sorted(clean.glob("part-*.h5")):
        assert shard.read_bytes() == (crashed / shard.name).read_bytes()
    # and a third run is a no-op that confirms the finished dataset
    assert run_cli(*pack_args(inputs, crashed, "--workers", 1)) == 0


def test_tfrecord_inputs_pack_like_hdf5(tmp_path):
    from tfrecord.writer import TFRecordWriter

    rng = np.random.default_rng(3)
    rows = synthetic_rows(rng.integers(3, S + 1, size=300), S, P, rng)
    (tmp_path / "h5").mkdir()
    write_unpacked_shard(tmp_path / "h5" / "data.h5", rows)
    (tmp_path / "tf").mkdir()
    writer = TFRecordWriter(str(tmp_path / "tf" / "data.tfrecord"))
    for r in range(300):
        writer.write({name: (np.atleast_1d(rows[name][r]).tolist(), "int") for name in rows})
    writer.close()
    for kind, pattern in (("h5", "*.h5"), ("tf", "*.tfrecord")):
        common = (
            "--output",
            tmp_path / f"out-{kind}",
            "--max-sequence-length",
            S,
            "--max-predictions-per-seq",
            P,
        )
        assert run_cli("pack", "--input", f"{tmp_path / kind}/{pattern}", *common, "--quiet") == 0
    assert (
        run_cli("verify", "--input", f"{tmp_path}/tf/*.tfrecord", "--packed", tmp_path / "out-h5", "--quiet")
        == 0
    )
    with (
        h5py.File(tmp_path / "out-h5" / "part-00000.h5") as a,
        h5py.File(tmp_path / "out-tf" / "part-00000.h5") as b,
    ):
        for name in a:
            np.testing.assert_array_equal(a[name][:], b[name][:])


# ---------------------------------------------------------------------------------------
# Bad input: exit 2, a message naming file, field and row, nothing that looks complete
# ---------------------------------------------------------------------------------------
def _bad_file(folder, edit):
    rng = np.random.default_rng(0)
    rows = synthetic_rows(rng.integers(10, S + 1, size=50), S, P, rng)
    edit(rows)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bad.h5"
    with h5py.File(path, "w") as f:
        for name, values in rows.items():
            f.create_dataset(name, data=values)
    return path


BAD_ROWS = {
    "missing field": (lambda r: r.pop("segment_ids"), ["segment_ids", "missing"]),
    "mismatched shapes": (
        lambda r: r.__setitem__("segment_ids", r["segment_ids"][:40]),
        ["segment_ids", "40 rows"],
    ),
    "longer than N": (
        lambda r: r.update(
            {k: np.pad(r[k], ((0, 0), (0, 8))) for k in ("input_ids", "input_mask", "segment_ids")}
        ),
        ["input_ids", "width 136"],
    ),
    "non-prefix mask": (lambda r: r["input_mask"].__setitem__((7, 2), 0), ["row 7", "input_mask", "prefix"]),
    "masked position beyond": (
        lambda r: (
            r["masked_lm_positions"].__setitem__((9, 0), S - 1)
            or r["input_mask"].__setitem__((9, slice(S - 1, None)), 0)
        ),
        ["row 9", "masked_lm_positions", "outside the sequence"],
    ),
    "nsp label": (
        lambda r: r["next_sentence_labels"].__setitem__(11, 2),
        ["row 11", "next_sentence_labels", "0 or 1"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_input_is_refused_with_file_field_and_row(tmp_path, capsys, case):
    edit, words = BAD_ROWS[case]
    path = _bad_file(tmp_path / "in", edit)
    out = tmp_path / "out"
    assert run_cli(*pack_args(tmp_path / "in", out)) == 2
    err = capsys.readouterr().err
    assert str(path) in err and all(w in err for w in words), err
    assert not (out / "metadata.json").exists() and not list(out.glob("part-*.h5"))


def test_skip_invalid_skips_reports_and_counts(tmp_path, capsys):
    def two_bad(rows):
        rows["input_mask"][7, 2] = 0
        rows["next_sentence_labels"][11] = 5

    path = _bad_file(tmp_path / "in", two_bad)
    out = tmp_path / "out"
    assert run_cli(*pack_args(tmp_path / "in", out, "--skip-invalid")) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["skipped_rows"] == 2 and meta["sequences"] == 48
    report = [json.loads(line) for line in (out / "skipped_rows.jsonl").read_text().splitlines()]
    assert [(r["row"], r["field"]) for r in report] == [(7, "input_mask"), (11, "next_sentence_labels")]
    assert all(r["file"] == str(path) for r in report)
    capsys.readouterr()
    assert run_cli("verify", "--input", f"{tmp_path}/in/*.h5", "--packed", out, "--quiet") == 0


def test_truncated_hdf5_is_refused(inputs, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    source = sorted(inputs.glob("*.h5"))[0]
    data = source.read_bytes()
    (tmp_path / "in" / "cut.h5").write_bytes(data[: len(data) // 2])
    assert run_cli(*pack_args(tmp_path / "in", tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "cut.h5" in err and ("truncated" in err or "not a readable HDF5" in err)
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_empty_glob_and_foreign_output_are_refused(inputs, tmp_path, capsys):
    assert run_cli(*pack_args(tmp_path / "nothing", tmp_path / "out")) == 2
    assert "matches no file" in capsys.readouterr().err
    assert run_cli(*pack_args(inputs, tmp_path / "out")) == 0
    assert run_cli(*pack_args(inputs, tmp_path / "out", "--seed", 99)) == 2
    assert "different packed dataset" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert run_cli(*pack_args(inputs, tmp_path / "other")) == 2
    assert "not empty" in capsys.readouterr().err


def test_cli_entry_point_exit_codes(inputs, tmp_path):
    """The documented commands, as a user runs them."""
    cmd = [sys.executable, "-m", "packed_transformers.packing"]
    done = subprocess.run(
        cmd + [str(a) for a in pack_args(inputs, tmp_path / "p")], cwd=REPO, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    shutil.copytree(tmp_path / "p", tmp_path / "q")
    _edit_shard(tmp_path / "q", lambda d: d["segment_ids"].__setitem__((0, 1), 1 - d["segment_ids"][0, 1]))
    done = subprocess.run(
        cmd + ["verify", "--input", f"{inputs}/*.h5", "--packed", str(tmp_path / "q"), "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "MISMATCH" in done.stdout


# ---------------------------------------------------------------------------------------
# Assignment properties
# ---------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), min_size=8, max_size=40).filter(lambda c: sum(c) > 0),
    algorithm=st.sampled_from(["spfhp", "lpfhp", "none"]),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_assignment_uses_every_sequence_once_in_matching_slots(counts, algorithm, k, seed):
    histogram = Histogram(np.array(counts, dtype=np.int64))
    plan = pack(histogram, algorithm, k)
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.repeat(np.arange(1, len(counts) + 1), counts))
    skipped = rng.random(lengths.size) < 0.1
    lengths_with_skips = np.insert(lengths, np.flatnonzero(skipped), 0)  # rows skipped as invalid
    table = assign_sequences(plan, lengths_with_skips, seed, k)
    used = table[table >= 0]
    valid = np.flatnonzero(lengths_with_skips > 0)
    assert np.array_equal(np.sort(used), valid)
    fill = np.where(table >= 0, lengths_with_skips[np.maximum(table, 0)], 0).sum(axis=1)
    assert fill.max() <= len(counts) and (table[:, 0] >= 0).all()
    assert np.array_equal(table, assign_sequences(plan, lengths_with_skips, seed, k))


def test_token_ids_past_uint16_are_refused_without_vocab_size(tmp_path, capsys):
    """Issue 22, D12: without --vocab-size, an id >= 65,536 used to be stored wrapped
    (70000 as 4464); now the row is refused, naming the flag, and nothing is written."""
    from packed_transformers.data.synthetic import synthetic_rows
    from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

    rng = np.random.default_rng(0)
    rows = synthetic_rows(rng.integers(8, S + 1, size=20), S, P, rng, vocab_size=5000)
    rows["input_ids"][3, 1] = 70000
    (tmp_path / "in").mkdir()
    write_unpacked_shard(tmp_path / "in" / "part-00000.h5", rows, vocab_size=100000)
    assert run_cli(*pack_args(tmp_path / "in", tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "70000" in err and "--vocab-size" in err and "row 3" in err, err
    assert not (tmp_path / "out" / "metadata.json").exists()
    assert run_cli(*pack_args(tmp_path / "in", tmp_path / "wide", "--vocab-size", 100000)) == 0


def test_pack_after_fixing_a_bad_input_in_place_runs(tmp_path, capsys):
    """Issue 22, D17: a pack refused for a bad row leaves nothing behind, so the same
    command succeeds once the input is fixed in place."""
    from packed_transformers.data.synthetic import synthetic_rows
    from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

    rng = np.random.default_rng(0)
    rows = synthetic_rows(rng.integers(8, S + 1, size=20), S, P, rng, vocab_size=5000)
    good = {k: v.copy() for k, v in rows.items()}
    rows["input_ids"][2, 1] = 70000
    (tmp_path / "in").mkdir()
    write_unpacked_shard(tmp_path / "in" / "part-00000.h5", rows, vocab_size=100000)
    assert run_cli(*pack_args(tmp_path / "in", tmp_path / "out")) == 2
    assert not (tmp_path / "out").exists()
    write_unpacked_shard(tmp_path / "in" / "part-00000.h5", good, vocab_size=100000)
    assert run_cli(*pack_args(tmp_path / "in", tmp_path / "out", "--vocab-size", 5000)) == 0
    capsys.readouterr()
