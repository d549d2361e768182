"""The MLPerf eval-set picker: the reference's rows (records[int(i * N / count)]), from HDF5 or
TFRecord inputs, into a shard the packer takes."""

from __future__ import annotations

import json

import h5py
import numpy as np

from packed_transformers.data.pick_eval_samples import main as pick_main
from packed_transformers.data.pick_eval_samples import picked_rows
from packed_transformers.data.synthetic import synthetic_rows
from packed_transformers.packing.cli import main as packing_main
from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

S, P = 32, 5


def test_rows_follow_the_reference_formula():
    # The reference: pick_ratio = num_examples / num_examples_to_pick; records[int(i * pick_ratio)].
    for total, count in [(10_000, 10_000), (10_001, 10_000), (29_999, 10_000), (123_457, 10_000), (7, 3)]:
        rows = picked_rows(total, count)
        ratio = total / count
        assert rows == [int(i * ratio) for i in range(count)]
        assert len(set(rows)) == count and rows[0] == 0 and rows[-1] < total and rows == sorted(rows)
    assert picked_rows(20_000, 10_000) == list(range(0, 20_000, 2))


def test_pick_from_hdf5_and_tfrecord_then_pack(tmp_path):
    from tfrecord.writer import TFRecordWriter

    rng = np.random.default_rng(5)
    sizes = [1_200, 1_700, 601]
    parts = [synthetic_rows(rng.integers(4, S + 1, size=n), S, P, rng) for n in sizes]
    (tmp_path / "h5").mkdir()
    (tmp_path / "tf").mkdir()
    for k, rows in enumerate(parts):
        write_unpacked_shard(tmp_path / "h5" / f"eval-{k}.h5", rows)
        writer = TFRecordWriter(str(tmp_path / "tf" / f"eval-{k}.tfrecord"))
        for r in range(sizes[k]):
            writer.write({name: (np.atleast_1d(rows[name][r]).tolist(), "int") for name in rows})
        writer.close()
    everything = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    expected_rows = picked_rows(sum(sizes), 1_000)
    for kind, pattern in (("h5", "*.h5"), ("tf", "*.tfrecord")):
        out = tmp_path / f"picked-{kind}"
        assert (
            pick_main(["--input", str(tmp_path / kind / pattern), "--output", str(out), "--count", "1000"])
            == 0
        )
        with h5py.File(out / "part-00000.h5") as f:
            for name, values in everything.items():
                np.testing.assert_array_equal(
                    f[name][:].reshape(1000, -1), values[expected_rows].reshape(1000, -1)
                )
        assert json.loads((out / "picked.json").read_text())["source_rows"] == expected_rows
    packed = tmp_path / "packed"
    common = ["--max-sequence-length", str(S), "--max-predictions-per-seq", str(P), "--quiet"]
    assert (
        packing_main(["pack", "--input", f"{tmp_path}/picked-h5/*.h5", "--output", str(packed), *common]) == 0
    )
    assert (
        packing_main(["verify", "--input", f"{tmp_path}/picked-h5/*.h5", "--packed", str(packed), "--quiet"])
        == 0
    )


def test_more_than_there_is_refused(tmp_path, capsys):
    rng = np.random.default_rng(0)
    write_unpacked_shard(tmp_path / "a.h5", synthetic_rows(rng.integers(4, S, size=50), S, P, rng))
    assert (
        pick_main(["--input", str(tmp_path / "a.h5"), "--output", str(tmp_path / "o"), "--count", "51"]) == 2
    )
    assert "more than the 50 sequences" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
