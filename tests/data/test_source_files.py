"""Source data and vocabulary files that are damaged or misused: a flipped bit in a TFRecord,
a bad row in pick's source, OS errors in the converter, train_vocab's refusals, synthetic
data too short for k; and the README's news JSON-lines input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ..conftest import REPO


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


def test_a_flipped_bit_in_a_tfrecord_is_refused_by_its_crc(tmp_path, capsys):
    """#9: TFRecord CRCs were never checked: one flipped bit (token 1477 -> 1476) passed
    pick, pack and verify. The good file is written by the `tfrecord` package, so its
    CRCs also judge our masked CRC-32C."""
    import struct

    import numpy as np
    from tfrecord.writer import TFRecordWriter

    from packed_transformers.data.synthetic import synthetic_rows
    from packed_transformers.packing.cli import main as packing_main

    from ..training_helpers import P, S

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


def test_pick_names_a_bad_row_in_its_source_and_os_errors_are_one_line(tmp_path, capsys):
    """#14 and #10: pick copied invalid rows (the later error named the picked row, not the
    source's), and an output it cannot write was a traceback."""
    import numpy as np

    from packed_transformers.data.pick_eval_samples import main as pick_main
    from packed_transformers.data.pick_eval_samples import picked_rows
    from packed_transformers.data.synthetic import synthetic_rows
    from packed_transformers.packs.unpacked_hdf5 import write_unpacked_shard

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

    from ..model_helpers import bert_config_json

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


def test_synthetic_data_too_short_for_k_is_a_config_error():
    """#14: S < 8K with synthetic data was a ValueError traceback."""
    from packed_transformers.training.config import ConfigError, validate

    raw = {"data": {"synthetic": True, "max_sequence_length": 16, "max_sequences_per_pack": 3,
                    "synthetic_packing_factor": 2.0},
           "logging": {"mlperf": False}, "model": {"preset": "bert-tiny"}}  # fmt: skip
    with pytest.raises(ConfigError, match="too short for data.max_sequences_per_pack 3"):
        validate(raw)


def run(*argv, timeout=60):
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    return done, time.perf_counter() - started


def test_the_news_jsonl_recipe_input_is_the_corpus_in_the_users_format(tmp_path):
    """Recipe 2's first command: every BBC article once, as {"text", "text_pair", "label"};
    a device or a folder as the output is one line, exit 2, and is left as it is."""
    import json

    from packed_transformers.data.assets import corpus_files

    done, _ = run("-m", "packed_transformers.data.assets", "news-jsonl", tmp_path / "news.jsonl")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (tmp_path / "news.jsonl").read_text().splitlines()]
    assert len(lines) == len(corpus_files()) == 2225
    assert {line["label"] for line in lines} == {"business", "entertainment", "politics", "sports", "tech"}
    assert all(isinstance(line["text"], str) and line["text"] for line in lines)
    for output in ("/dev/null", tmp_path):
        done, _ = run("-m", "packed_transformers.data.assets", "news-jsonl", output)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "regular file" in done.stderr and "Traceback" not in done.stderr
