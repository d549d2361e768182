"""Raw text -> MLPerf-layout unpacked shards: structure and masking statistics on real BBC text."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from packed_transformers.data import assets
from packed_transformers.data.create_pretraining_data import main as create_main
from packed_transformers.data.create_pretraining_data import read_document, split_sentences
from packed_transformers.packing.cli import main as packing_main

S, P = 128, 20
CLS, SEP, MASK = 101, 102, 103


@pytest.fixture(scope="module")
def created(tmp_path_factory):
    try:
        files = assets.corpus_files()
        vocab = assets.vocab_file()
    except assets.MissingAsset as err:
        pytest.skip(str(err))
    out = tmp_path_factory.mktemp("created")
    chosen = files[::7]  # ~318 articles across the five categories
    argv = ["--input", *map(str, chosen), "--input-format", "one-document-per-file"]
    argv += ["--vocab", str(vocab), "--output", str(out), "--quiet"]
    argv += ["--max-seq-length", str(S), "--max-predictions-per-seq", str(P), "--dupe-factor", "2"]
    argv += ["--eval-documents", "20", "--rows-per-shard", "1500", "--seed", "3"]
    assert create_main(argv) == 0
    arrays = {}
    for path in sorted(out.glob("part-*.h5")):
        with h5py.File(path) as f:
            for name in f:
                arrays.setdefault(name, []).append(f[name][:])
    return out, {name: np.concatenate(parts) for name, parts in arrays.items()}


def test_fields_and_sentence_pair_structure(created):
    out, a = created
    n = a["input_ids"].shape[0]
    assert n > 2000 and a["input_ids"].shape == (n, S) and a["masked_lm_positions"].shape == (n, P)
    lengths = a["input_mask"].sum(axis=1)
    assert lengths.min() >= 5 and lengths.max() == S
    rows = np.arange(n)
    assert (a["input_ids"][:, 0] == CLS).all()
    original = a["input_ids"].copy()
    for r in range(n):  # undo masking to see the true [SEP]s
        used = a["masked_lm_positions"][r] > 0
        original[r, a["masked_lm_positions"][r][used]] = a["masked_lm_ids"][r][used]
    assert (original[rows, lengths - 1] == SEP).all()
    segment_b_start = (a["segment_ids"] == 1).argmax(axis=1)
    assert (original[rows, segment_b_start - 1] == SEP).all()
    assert set(np.unique(a["next_sentence_labels"])) == {0, 1}
    assert 0.35 < a["next_sentence_labels"].mean() < 0.65
    meta = json.loads((out / "creation.json").read_text())
    assert meta["sequences"] == n and meta["eval_sequences"] > 0 and list(out.glob("eval/part-*.h5"))


def test_masking_statistics_follow_the_recipe(created):
    _, a = created
    lengths = a["input_mask"].sum(axis=1)
    used = a["masked_lm_positions"] > 0
    predictions = used.sum(axis=1)
    expected = np.minimum(P, np.maximum(1, np.round(lengths * 0.15)))
    assert np.array_equal(predictions, expected)
    assert abs(predictions.sum() / lengths.sum() - 0.15) < 0.02
    shown = np.take_along_axis(a["input_ids"], a["masked_lm_positions"], axis=1)[used]
    labels = a["masked_lm_ids"][used]
    as_mask = np.mean(shown == MASK)
    kept = np.mean(shown == labels)
    replaced = 1 - as_mask - kept
    assert abs(as_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02 and abs(replaced - 0.1) < 0.02
    assert not np.isin(labels, [CLS, SEP]).any(), "[CLS]/[SEP] are never masked"


def test_created_data_packs_and_verifies(created, tmp_path):
    out, _ = created
    common = ["--max-sequence-length", str(S), "--max-predictions-per-seq", str(P), "--vocab-size", "30522"]
    assert (
        packing_main(
            ["pack", "--input", f"{out}/part-*.h5", "--output", str(tmp_path / "p"), *common, "--quiet"]
        )
        == 0
    )
    assert (
        packing_main(["verify", "--input", f"{out}/part-*.h5", "--packed", str(tmp_path / "p"), "--quiet"])
        == 0
    )


def test_cp1252_file_and_sentence_split(tmp_path):
    path = tmp_path / "legacy.txt"
    path.write_bytes(
        "Caf\xe9 prices rose 5%. Analysts \x93expect\x94 more!\n\nSecond paragraph here.".encode("latin-1")
    )
    text, legacy = read_document(path)
    assert legacy and "Café" in text and "\u201cexpect\u201d" in text
    assert split_sentences(text) == [
        "Café prices rose 5%.",
        "Analysts \u201cexpect\u201d more!",
        "Second paragraph here.",
    ]


def test_bad_arguments_exit_2(tmp_path, capsys):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\nhello\n")
    doc = tmp_path / "d.txt"
    doc.write_text("Hello there. General Kenobi.")
    assert (
        create_main(
            ["--input", str(tmp_path / "none*.txt"), "--vocab", str(vocab), "--output", str(tmp_path / "o")]
        )
        == 2
    )
    assert "matches no file" in capsys.readouterr().err
    assert create_main(["--input", str(doc), "--vocab", str(vocab), "--output", str(tmp_path / "o")]) == 2
    assert "[CLS] is missing" in capsys.readouterr().err
