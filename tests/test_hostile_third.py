"""Defects of the third hostile test (issue 34) that are fixed, one test each; every test
failed before its fix."""

from __future__ import annotations

import json
import os

import pytest

from packed_transformers.common.files import FolderInUse, lock_folder, output_over_inputs

from .training_helpers import make_packed, metrics, run, write_config


def test_an_output_never_resolves_to_an_input_or_into_a_folder_read(tmp_path):
    """#3: the shared check, symlinks followed."""
    source = tmp_path / "corpus.txt"
    source.write_text("x")
    (tmp_path / "link.txt").symlink_to(source)
    model = tmp_path / "model"
    model.mkdir()
    assert "also an input" in output_over_inputs(tmp_path / "link.txt", [source])
    assert "inside" in output_over_inputs(model / "vocab.txt", [], [model])
    assert output_over_inputs(tmp_path / "out.txt", [source], [model]) is None
    assert "is a directory" in output_over_inputs(tmp_path, [source])


def test_train_vocab_refuses_its_corpus_as_output_an_empty_corpus_and_absurd_sizes(tmp_path, capsys):
    """#3 and #11: the corpus survives; no specials-only vocabulary; no 70 GB allocation."""
    from packed_transformers.data import train_vocab

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n\nthe dog sat on the log\n")
    before = corpus.read_text()
    assert train_vocab.main(["--input", str(corpus), "--output", str(corpus), "--vocab-size", "50"]) == 2
    assert corpus.read_text() == before and "also an input" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert (
        train_vocab.main(["--input", str(empty), "--output", str(tmp_path / "v.txt"), "--vocab-size", "50"])
        == 2
    )
    assert "no text" in capsys.readouterr().err and not (tmp_path / "v.txt").exists()
    huge = ["--input", str(corpus), "--output", str(tmp_path / "v.txt"), "--vocab-size", "1000000000"]
    assert train_vocab.main(huge) == 2 and "--vocab-size" in capsys.readouterr().err


def test_predict_checks_its_output_can_be_written_before_inference(tmp_path, capsys):
    """#10: an output that cannot be written (here: a folder under a file, which root cannot
    write either) is one line before any compute, not a lost finished inference."""
    from packed_transformers.commands import predict

    (tmp_path / "a_file").write_text("x")
    code = predict.main(["--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.jsonl"),
                         "--output", str(tmp_path / "a_file" / "p.jsonl")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "a_file" in err


def test_predict_refuses_an_output_inside_the_model_folder(tmp_path, capsys):
    """#3: `--output M/vocab.txt` no longer replaces the model's vocabulary."""
    from packed_transformers.commands import predict

    model = tmp_path / "model"
    model.mkdir()
    (model / "vocab.txt").write_text("[PAD]\n")
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a"}\n')
    code = predict.main(["--model", str(model), "--input", str(source), "--output", str(model / "vocab.txt")])
    assert code == 2 and "inside" in capsys.readouterr().err
    assert (model / "vocab.txt").read_text() == "[PAD]\n"


def test_the_folder_lock_follows_symlinks(tmp_path):
    """#6: runs/A -> runs/B and runs/B take the same lock."""
    import subprocess
    import sys

    real = tmp_path / "B"
    real.mkdir()
    (tmp_path / "A").symlink_to(real)
    code = "import sys, time; from packed_transformers.common.files import lock_folder; lock_folder(sys.argv[1], 'run'); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "A")], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse):
            lock_folder(real, "run")
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_cut_off_last_metrics_line_is_dropped_on_resume_and_in_summary(tmp_path):
    """#5 and #13: a disk that filled mid-line left half a JSON record; --resume and
    training.summary read the complete lines and go on."""
    from packed_transformers.training import summary

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0
    path = tmp_path / "run" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # no newline: cut off
    assert summary.main(["--packed", str(tmp_path / "run")]) == 0
    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=6")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    for line in path.read_text().splitlines():
        json.loads(line)


def test_summary_of_a_foreign_or_broken_folder_is_one_line(tmp_path, capsys):
    """#13: a missing folder, a binary metrics.jsonl: exit 2, one line."""
    from packed_transformers.training import summary

    assert summary.main(["--packed", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("data: {train_dir: " + str(tmp_path) + "}\n")
    (tmp_path / "metadata.json").write_text('{"packing_factor": 1.0}')
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b"\x00\xff\xfe binary\n")
    assert summary.main(["--packed", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err


@pytest.mark.slow
def test_resume_refuses_other_data_at_the_same_path_and_reads_the_checkpoints_config(tmp_path):
    """#1: re-packed with K 3 -> 2 at the same path, --resume went on (exit 0) with another
    packing factor; #14: with config.yaml deleted, any change was accepted. Both exit 2 now."""
    import shutil

    from packed_transformers.packing.pipeline import PackJob, run_pack

    from .training_helpers import VOCAB, P, S

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0

    shutil.copy(tmp_path / "run" / "config.yaml", tmp_path / "kept.yaml")
    (tmp_path / "run" / "config.yaml").unlink()
    other = write_config(tmp_path / "o.yaml", packed, training={"max_steps": 4}, optim={"lr": 0.5})
    done = run(other, tmp_path / "run", "--resume")
    assert done.returncode == 2 and "optim.lr" in done.stderr and "the checkpoint" in done.stderr
    shutil.copy(tmp_path / "kept.yaml", tmp_path / "run" / "config.yaml")

    for name in ("train", "eval"):  # re-packed in place with K = 2
        shutil.rmtree(packed / name)
        job = PackJob(inputs=(str(packed / f"raw-{name}" / "part-00000.h5"),), output=str(packed / name),
                      algorithm="lpfhp", max_sequences_per_pack=2, max_sequence_length=S,
                      max_predictions_per_seq=P, seed=1, shard_size=100, vocab_size=VOCAB)  # fmt: skip
        run_pack(job, quiet=True)
    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=4")
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "metadata.json" in error[0] and "changed" in error[0]


@pytest.mark.slow
def test_eval_data_for_a_bigger_vocabulary_is_refused_at_start_naming_the_settings(tmp_path):
    """#4: the eval set was not checked against the model (a traceback at the first
    evaluation, hours in); the message now names model.vocab_size and packing's --vocab-size."""
    import shutil

    from packed_transformers.packing.pipeline import PackJob, run_pack

    from .training_helpers import VOCAB, P, S

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    shutil.rmtree(packed / "eval")
    job = PackJob(inputs=(str(packed / "raw-eval" / "part-00000.h5"),), output=str(packed / "eval"),
                  algorithm="lpfhp", max_sequences_per_pack=3, max_sequence_length=S,
                  max_predictions_per_seq=P, seed=1, shard_size=100, vocab_size=VOCAB * 4)  # fmt: skip
    run_pack(job, quiet=True)
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2})
    done = run(config, tmp_path / "run")
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "data.eval_dir" in error[0] and "model.vocab_size" in error[0]
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.slow
def test_skipped_steps_are_logged_as_skipped_and_their_budget_survives_resume(tmp_path):
    """#12: a window of skipped steps was logged as loss 0.0 (reads as perfect), broke
    training.summary (ZeroDivisionError), and --resume reset the skip budget; the pipeline
    engine accepted `skip` and never applied it."""
    from packed_transformers.training import summary

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    nan = {"optim": {"lr": 1e6}}  # every step's loss and gradients overflow
    # lr 1e6: steps 1-2 finite, every later one non-finite (skipped, weights untouched)
    config = write_config(tmp_path / "c.yaml", packed, **nan, training={
        "max_steps": 4, "on_nonfinite": "skip", "max_skipped_steps": 3})  # fmt: skip
    done = run(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    rows = metrics(tmp_path / "run")
    skipped = [r for r in rows if r.get("skipped_steps")]
    assert [r["step"] for r in skipped] == [3, 4] and all(r["loss"] is None for r in skipped)
    assert summary.main(["--packed", str(tmp_path / "run")]) == 0
    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=6")
    assert done.returncode == 3, done.stderr  # steps 3, 4 before; 5 is the 3rd of 3, 6 the 4th
    assert "more than 3 skipped steps" in done.stderr
    pipeline = write_config(tmp_path / "p.yaml", packed, training={"on_nonfinite": "skip"},
                            execution={"device": "cpu", "threads": 1, "layers_per_stage": [1, 1]})  # fmt: skip
    done = run(pipeline, tmp_path / "pipe")
    assert done.returncode == 2 and "training.on_nonfinite skip" in done.stderr


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
    from packed_transformers.packing.structure import first_malformed

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

    from packed_transformers.packing.shards import PackedDataset
    from packed_transformers.training.data import PackedShards, ShardReadError

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


def test_a_flipped_bit_in_a_tfrecord_is_refused_by_its_crc(tmp_path, capsys):
    """#9: TFRecord CRCs were never checked: one flipped bit (token 1477 -> 1476) passed
    pick, pack and verify. The good file is written by the `tfrecord` package, so its
    CRCs also judge our masked CRC-32C."""
    import struct

    import numpy as np
    from tfrecord.writer import TFRecordWriter

    from packed_transformers.data.synthetic import synthetic_rows
    from packed_transformers.packing.cli import main as packing_main

    from .training_helpers import P, S

    rng = np.random.default_rng(3)
    rows = synthetic_rows(rng.integers(3, S + 1, size=20), S, P, rng)
    path = tmp_path / "data.tfrecord"
    writer = TFRecordWriter(str(path))
    for r in range(20):
        writer.write({name: (np.atleast_1d(rows[name][r]).tolist(), "int") for name in rows})
    writer.close()
    args = ["pack", "--input", str(path), "--max-sequence-length", str(S),
            "--max-predictions-per-seq", str(P), "--quiet", "--output"]  # fmt: skip
    assert packing_main([*args, str(tmp_path / "good")]) == 0
    blob = bytearray(path.read_bytes())
    offset = 0
    for _ in range(5):  # to record 5
        offset += 12 + struct.unpack_from("<Q", blob, offset)[0] + 4
    length = struct.unpack_from("<Q", blob, offset)[0]
    blob[offset + 12 + length // 2] ^= 1
    path.write_bytes(bytes(blob))
    capsys.readouterr()
    assert packing_main([*args, str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "row 5" in err and "CRC" in err and not (tmp_path / "bad" / "metadata.json").exists()
    blob[offset + 3] ^= 1  # the length itself: refused at the scan
    path.write_bytes(bytes(blob))
    assert packing_main([*args, str(tmp_path / "bad")]) == 2
    assert "record 5" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("limit", [500_000, 1_000_000])
def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_half_checkpoint(tmp_path, limit):
    """#5: safetensors' SafetensorError (model.safetensors is 751 kB here: limit 500 kB)
    and torch.save's "unexpected pos" (training_state.pt is 1.5 MB: limit 1 MB) are not
    OSError: they were a traceback, exit 1, no path. A real file-size limit."""
    import resource
    import signal
    import subprocess
    import sys

    from .conftest import REPO

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2})
    done = subprocess.run(
        [sys.executable, "run_pretraining.py", "--config", str(config), "--output-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=small_files,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "step-00000002" in error[0] and "writing the checkpoint failed" in error[0]
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []  # no half-written folder


def test_pick_names_a_bad_row_in_its_source_and_os_errors_are_one_line(tmp_path, capsys):
    """#14 and #10: pick copied invalid rows (the later error named the picked row, not the
    source's), and an output it cannot write was a traceback."""
    import numpy as np

    from packed_transformers.data.pick_eval_samples import main as pick_main
    from packed_transformers.data.pick_eval_samples import picked_rows
    from packed_transformers.data.synthetic import synthetic_rows
    from packed_transformers.packing.unpacked_hdf5 import write_unpacked_shard

    rng = np.random.default_rng(0)
    rows = synthetic_rows(rng.integers(4, 32, size=50), 32, 5, rng)
    bad_row = picked_rows(50, 10)[3]  # 15: picked as row 3
    rows["segment_ids"][bad_row, 1] = 7
    write_unpacked_shard(tmp_path / "a.h5", rows)
    args = ["--input", str(tmp_path / "a.h5"), "--count", "10", "--output"]
    assert pick_main([*args, str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"a.h5: row {bad_row}: field 'segment_ids'" in err and not (tmp_path / "o").exists()
    rows["segment_ids"][bad_row, 1] = 0
    write_unpacked_shard(tmp_path / "a.h5", rows)
    (tmp_path / "afile").write_text("x")
    assert pick_main([*args, str(tmp_path / "afile" / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "afile" in err


def test_the_converter_reports_os_errors_in_one_line(tmp_path, capsys):
    """#10: an unreadable checkpoint or an output under a file was a traceback."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    from packed_transformers.data.convert_tf_checkpoint import main as convert_main

    from .model_helpers import bert_config_json

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=32)  # fmt: skip
    torch.save({"model": BertForPreTraining(config).state_dict()}, tmp_path / "ckpt.pt")
    (tmp_path / "bert_config.json").write_text(json.dumps(bert_config_json(config)))
    (tmp_path / "afile").write_text("x")
    base = ["--from", "nvidia-pt", "--bert-config", str(tmp_path / "bert_config.json"), "--checkpoint"]
    for checkpoint, output in (
        (tmp_path / "missing.pt", tmp_path / "hf"),
        (tmp_path / "ckpt.pt", tmp_path / "afile" / "hf"),
    ):
        assert convert_main([*base, str(checkpoint), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
    assert convert_main([*base, str(tmp_path / "ckpt.pt"), "--output", str(tmp_path / "hf")]) == 0


def test_summary_reports_the_runs_end_not_its_last_logging_window(tmp_path, capsys):
    """#13: a 19-step, 60 s run stopped by a time limit between windows was reported as
    10 steps / 36 s (its last logged window)."""
    import yaml

    from packed_transformers.training import summary

    data = tmp_path / "data"
    data.mkdir()
    (data / "metadata.json").write_text(json.dumps({"packing_factor": 1.5}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"data": {"train_dir": str(data), "eval_dir": None, "max_sequence_length": 64},
              "model": {"preset": "bert-tiny"}, "eval": {"max_sequences": 10}}  # fmt: skip
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    window = {
        "kind": "train",
        "loss": 7.0,
        "sequences": 75,
        "sequences_per_second": 4.2,
        "tokens_per_second": 90.0,
    }
    lines = [
        {**window, "step": 5, "samples": 75, "train_seconds": 18.0},
        {**window, "step": 10, "samples": 150, "train_seconds": 36.0},
        {
            "kind": "end",
            "step": 19,
            "samples": 290,
            "status": "aborted",
            "seconds": 61.0,
            "train_seconds": 60.0,
        },
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert summary.main(["--packed", str(run_dir)]) == 0
    assert (
        "| 1.500 | 19 | aborted | 290 | 60 |" in capsys.readouterr().out
    )  # an end record from before stopped_by
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    assert summary.main(["--packed", str(run_dir)]) == 0  # killed before its end record
    assert "| 1.500 | 10 | - | 150 | 36 |" in capsys.readouterr().out


def test_a_manifest_that_lists_nothing_proves_nothing(tmp_path):
    """#14: a manifest without 'files' was a KeyError, one with {} was accepted as intact."""
    from packed_transformers.training.checkpoint import CheckpointError, check_checkpoint

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
    from packed_transformers.packing.errors import PackingInputError
    from packed_transformers.packing.shards import PackedDataset

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


def test_finetune_json_of_wrong_types_and_truncated_weights_are_one_line(tmp_path, capsys):
    """#14: finetune.json 'fields' as a string, and a truncated model.safetensors
    (SafetensorError), were tracebacks in commands.predict."""
    from packed_transformers.commands import predict
    from packed_transformers.model.bert_heads import PackedBertForSequenceClassification
    from packed_transformers.model.config import bert_config

    model_dir = tmp_path / "m"
    config = bert_config("bert-tiny", vocab_size=100, num_labels=2)
    config.problem_type = "single_label_classification"
    model = PackedBertForSequenceClassification(config)
    model.save_pretrained(model_dir)
    (model_dir / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]) + "\n"
    )
    info = {"task": "classification", "labels": ["x", "y"], "multi_label": False, "max_sequence_length": 32,
            "fields": "text"}  # fmt: skip
    (model_dir / "finetune.json").write_text(json.dumps(info))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "a a"}) + "\n")
    capsys.readouterr()  # the save's progress bar
    args = [
        "--model",
        str(model_dir),
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "p.jsonl"),
    ]
    assert predict.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fields' must be an object" in err
    info["fields"] = {"text": "text", "pair": None, "label": None}
    (model_dir / "finetune.json").write_text(json.dumps(info))
    weights = model_dir / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert predict.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be loaded" in err and "truncated" in err


def test_a_huge_text_field_is_refused_before_tokenizing(tmp_path):
    """#14: a 20 MB line was tokenized whole (3.4 GB)."""
    from packed_transformers.data.classification_data import MAX_FIELD_CHARS, ExampleError, read_jsonl

    path = tmp_path / "in.jsonl"
    path.write_text(
        json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "word " * (MAX_FIELD_CHARS // 5 + 1)}) + "\n"
    )
    with pytest.raises(ExampleError, match=r"in.jsonl:2: field 'text' has 1,000,005 characters"):
        read_jsonl(path, "text", "pair", "label", need_labels=False)


def test_synthetic_data_too_short_for_k_is_a_config_error():
    """#14: S < 8K with synthetic data was a ValueError traceback."""
    from packed_transformers.training.config import ConfigError, validate

    raw = {"data": {"synthetic": True, "max_sequence_length": 16, "max_sequences_per_pack": 3,
                    "synthetic_packing_factor": 2.0},
           "logging": {"mlperf": False}, "model": {"preset": "bert-tiny"}}  # fmt: skip
    with pytest.raises(ConfigError, match="too short for data.max_sequences_per_pack 3"):
        validate(raw)
