"""data.create_pretraining_data against google-research/bert's own generator and tokenizer
(tests/reference_bert.py): the same six fields, byte for byte, for the same seed and text.

Any drift in document splitting, tokenization or the order of random draws changes the
instances and fails these tests."""

from __future__ import annotations

import functools
import random

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packed_transformers.data import assets
from packed_transformers.data.create_pretraining_data import main as create_main
from packed_transformers.data.create_pretraining_data import read_document, split_sentences
from packed_transformers.data.reference_tokenizer import ReferenceTokenizer, read_vocab
from packed_transformers.packing.sources import FIELDS
from tests import reference_bert
from tests.conftest import fast_loop_keeps

# Text that trips tokenizers: special-token strings, words of 150 and 250 characters (the
# reference's limit is 200), accents and combining marks, CJK, controls, format characters,
# odd whitespace (NBSP, U+2028, form feed), private use, emoji, right-to-left scripts.
HOSTILE_LINES = [
    "Literal [SEP] and [MASK] and [CLS] and [UNK] and [PAD] strings are text.",
    "A long word " + "abcdefghij" * 15 + " and a longer one " + "klmnopqrst" * 25 + ".",
    "Café naïve coöperate Ångström résumé İstanbul ΣΊΣΥΦΟΣ ΟΔΟΣ.",
    "CJK 中文字符 and かな and 한국어 mixed in.",
    "Controls\x01 inside\x7f words and a tab\there.",
    "Zero\u200bwidth and soft\u00adhyphen and joiner\u200dhere.",
    "Non\u00a0breaking space, line\u2028separator, form\x0cfeed, thin\u2009space.",
    "Private \ue000 use and emoji 🙂👍🏽 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "Arabic العربية and Hebrew עברית text.",
    "Symbols ^ $ ` ~ | \\ < > and « guillemets » and – dashes —.",
    "\x0c",
    "\u200b",
]


def _reference_corpus(folder, files, hostile_every=7):
    """BBC articles in the reference's format (a sentence per line, blank line between
    documents), hostile lines sprinkled in, over two files: the first ends without a blank
    line (its last document runs on into the next file, as in the reference) and uses CRLF."""
    docs = []
    for k, path in enumerate(files):
        sentences = split_sentences(read_document(path)[0])
        if k % hostile_every == 0:
            sentences.insert(len(sentences) // 2, HOSTILE_LINES[k // hostile_every % len(HOSTILE_LINES)])
        docs.append(sentences)
    half = len(docs) // 2
    first = "\r\n\r\n".join("\r\n".join(d) for d in docs[:half]) + "\r\n"
    second = "\n\n\n".join("\n".join(d) for d in docs[half:])  # runs of blank lines, no final newline
    paths = [folder / "part-00000-of-00002", folder / "part-00001-of-00002"]
    paths[0].write_text(first, encoding="utf-8", newline="")
    paths[1].write_text(second, encoding="utf-8", newline="")
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    try:
        files, vocab = assets.corpus_files(), assets.vocab_file()
    except assets.MissingAsset as err:
        pytest.skip(str(err))
    folder = tmp_path_factory.mktemp("reference_corpus")
    return _reference_corpus(folder, files[::9]), vocab


def _ours(paths, vocab, out, seed, s, p, dupe, *extra):
    argv = ["--input", *map(str, paths), "--vocab", str(vocab), "--output", str(out), "--quiet"]
    argv += ["--max-seq-length", str(s), "--max-predictions-per-seq", str(p)]
    argv += ["--dupe-factor", str(dupe), "--seed", str(seed), *extra]
    assert create_main(argv) == 0
    arrays = {}
    for shard in sorted(out.glob("*.h5")):
        with h5py.File(shard) as f:
            for name in FIELDS:
                arrays.setdefault(name, []).append(f[name][:].astype(np.int64))
    return {name: np.concatenate(parts) for name, parts in arrays.items()}


@pytest.mark.parametrize(
    "seed,s,p,dupe",  # 3-4 s a case: the fast loop keeps one
    fast_loop_keeps([(12345, 128, 20, 2), (3, 64, 10, 1), (7, 512, 76, 1)], [(3, 64, 10, 1)]),
)
def test_same_instances_as_the_reference_byte_for_byte(corpus, tmp_path, seed, s, p, dupe):
    paths, vocab = corpus
    expected = reference_bert.reference_arrays(paths, vocab, seed, s, p, dupe)
    ours = _ours(paths, vocab, tmp_path / "o", seed, s, p, dupe, "--rows-per-shard", "700")
    assert len(expected["input_ids"]) > 300
    for name in FIELDS:
        assert ours[name].shape == expected[name].shape, name
        mismatch = np.flatnonzero((ours[name] != expected[name]).reshape(len(ours[name]), -1).any(axis=1))
        assert mismatch.size == 0, f"{name}: rows {mismatch[:5].tolist()} differ from the reference"
    # The reference's statistics, as a reader expects them: about half random-next pairs.
    assert 0.4 < expected["next_sentence_labels"].mean() < 0.65


@pytest.mark.slow
def test_per_part_mode_equals_one_reference_run_per_part(corpus, tmp_path):
    paths, vocab = corpus
    out = tmp_path / "parts"
    argv = ["--input", *map(str, paths), "--vocab", str(vocab), "--output", str(out), "--quiet"]
    argv += ["--max-seq-length", "128", "--max-predictions-per-seq", "20", "--dupe-factor", "1"]
    assert create_main([*argv, "--per-part", "--workers", "2"]) == 0
    for path in paths:
        expected = reference_bert.reference_arrays([path], vocab, 12345, 128, 20, 1)
        with h5py.File(out / f"{path.name}.h5") as f:
            for name in FIELDS:
                assert np.array_equal(f[name][:].astype(np.int64), expected[name]), (path.name, name)
    # A second run keeps the finished parts; without --skip-existing it refuses the folder.
    assert create_main([*argv, "--per-part", "--skip-existing"]) == 0
    assert create_main([*argv, "--per-part"]) == 2


def test_blank_lines_separate_documents(tmp_path, corpus):
    """The bug this replaces: a blank-line file read as ONE document gives no random-next
    pairs from other documents. 30 documents of 4 sentences -> 30 documents."""
    _, vocab = corpus
    text = "\n\n".join("\n".join(f"Document {d} sentence {k} is here." for k in range(4)) for d in range(30))
    path = tmp_path / "docs.txt"
    path.write_text(text)
    out = tmp_path / "o"
    assert (
        create_main(
            [
                "--input",
                str(path),
                "--vocab",
                str(vocab),
                "--output",
                str(out),
                "--quiet",
                "--max-seq-length",
                "32",
                "--max-predictions-per-seq",
                "5",
                "--dupe-factor",
                "1",
            ]
        )
        == 0
    )
    import json

    assert json.loads((out / "creation.json").read_text())["documents"] == 30


@functools.lru_cache(maxsize=4)
def our_tokenizer(vocab: str) -> ReferenceTokenizer:
    """Built once per vocabulary (the test is of tokenizing, not of reading vocab.txt 300 times)."""
    return ReferenceTokenizer(read_vocab(vocab))


_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=60
) | st.sampled_from(HOSTILE_LINES)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_text, min_size=1, max_size=8))
def test_tokenizer_equals_the_reference_on_any_text(corpus, lines):
    _, vocab = corpus
    lines = [line.strip() for line in lines]
    ours = our_tokenizer(str(vocab)).encode_lines(lines)
    assert ours == reference_bert.reference_tokenize(vocab, lines)


def test_random_word_draws_cover_the_vocabulary(corpus):
    """The 10% random words are drawn from all V ids by position in vocab.txt, as the
    reference's vocab_words[randint(0, V - 1)]."""
    _, vocab = corpus
    from packed_transformers.data.pretraining_instances import Recipe, SpecialIds, mask_tokens

    v = read_vocab(vocab)
    ids = SpecialIds.from_vocab(v)
    rng = random.Random(0)
    drawn = []
    for _ in range(400):
        tokens = [ids.cls] + [1000] * 60 + [ids.sep] + [1000] * 60 + [ids.sep]
        mask_tokens(tokens, 62, Recipe(128, 40), ids, rng)
        drawn += [t for t in tokens if t not in (1000, ids.mask, ids.cls, ids.sep)]
    assert min(drawn) < 500 and max(drawn) > len(v) - 500
