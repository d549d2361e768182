"""Packed sentence embeddings, judged by sentence-transformers itself.

The model is the real all-MiniLM-L6-v2 folder the assets ship (Transformer -> mean Pooling
-> Normalize). sentence-transformers' `encode` on the same texts is the reference: every
pooling mode, with and without Normalize, every batching mode and attention backend, on
BBC text from 1 token to past max_seq_length (set to 64 here, so that paragraphs are cut)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from packed_transformers.commands import embed as embed_command
from packed_transformers.data.assets import corpus_glob, model_dir
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.data.embedding_texts import bbc_articles, texts_of
from packed_transformers.door.st_folder import describe_embedding_folder
from packed_transformers.inference.embedding import (
    encode,
    encoder_from_sentence_transformer,
    load_encoder,
    packed_encode,
)
from packed_transformers.inference.options import InferenceOptions
from packed_transformers.model.embedding import POOLING_MODES

from ..conftest import fast_loop_keeps
from ..model_helpers import cosines

sentence_transformers = pytest.importorskip("sentence_transformers")
MAX_LENGTH = 64
BACKENDS = ["dense", "sdpa", "varlen", "flex"]


@pytest.fixture(scope="module")
def texts():
    """Short and long BBC texts, an empty one, a 1-token one, one far past 64 tokens, and
    text with surrounding spaces, accents, emoji and CJK."""
    articles = bbc_articles(corpus_glob())[:3]
    mixed = texts_of(articles, "mixed")
    return ["x", "", "  padded with spaces  ", "Émoji 😀 and 中文 text", " ".join(mixed[:20]), *mixed[:30]]


@pytest.fixture(scope="module")
def st_model():
    model = sentence_transformers.SentenceTransformer(str(model_dir()), device="cpu")
    model.max_seq_length = MAX_LENGTH
    return model


def with_pooling(st_model, mode, normalize: bool):
    """A SentenceTransformer sharing st_model's Transformer, with this Pooling (and Normalize)."""
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import Pooling

    modules = [st_model[0], Pooling(st_model[0].get_embedding_dimension(), pooling_mode=mode)]
    return sentence_transformers.SentenceTransformer(
        modules=modules + ([Normalize()] if normalize else []), device="cpu"
    )


def assert_same_vectors(ours, reference):
    assert ours.shape == reference.shape and ours.dtype == np.float32
    assert cosines(ours, reference).min() >= 0.99999
    np.testing.assert_allclose(ours, reference, atol=2e-5, rtol=1e-4)


def test_the_next_chunk_is_tokenized_beside_the_model_and_a_bad_text_waits_its_turn(texts):
    """iter_encode tokenizes chunk i+1 in its own thread while chunk i runs; a mistake in a
    later chunk is raised only after every earlier chunk's array was yielded."""
    import threading

    from packed_transformers.inference.embedding import iter_encode
    from packed_transformers.inference.options import InferenceOptions

    encoder = load_encoder(model_dir(), max_length=MAX_LENGTH)
    tokenized_in, real = [], encoder.tokenize_texts

    def recording(*args, **kwargs):
        tokenized_in.append(threading.current_thread().name)
        return real(*args, **kwargs)

    encoder.tokenize_texts = recording

    def lines():
        yield from texts[:8]
        raise ExampleError("in.jsonl:9: not valid JSON")

    got = []
    with pytest.raises(ExampleError, match="in.jsonl:9"):
        for chunk in iter_encode(lines(), encoder, InferenceOptions.for_embedding(chunk_texts=4)):
            got.append(chunk)
    assert [len(chunk) for chunk in got] == [4, 4]
    assert tokenized_in and all(name.startswith("tokenize") for name in tokenized_in)
    assert_same_vectors(np.concatenate(got), encode(texts[:8], encoder))


# ~3.3 s a case: the fast loop keeps MiniLM's own (mean, normalized) and last-token pooling
# (the case that reads a position), `make test` every one
@pytest.mark.parametrize(
    "mode,normalize",
    fast_loop_keeps(
        [(m, n) for m in POOLING_MODES for n in (True, False)], [("mean", True), ("lasttoken", False)]
    ),
)
def test_every_pooling_mode_equals_sentence_transformers(st_model, texts, mode, normalize):
    reference_model = with_pooling(st_model, mode, normalize)
    reference = reference_model.encode(texts, convert_to_numpy=True)
    encoder = encoder_from_sentence_transformer(reference_model)
    assert encoder.max_length == MAX_LENGTH and encoder.normalize == normalize
    for batching in ("packed", "sorted", "padded"):
        assert_same_vectors(encode(texts, encoder, batching=batching, batch_size=8), reference)


def test_two_pooling_modes_concatenate_as_sentence_transformers_does(st_model, texts):
    reference_model = with_pooling(st_model, ("cls", "mean"), True)
    encoder = encoder_from_sentence_transformer(reference_model)
    assert encoder.dimension == 2 * 384
    assert_same_vectors(encode(texts, encoder), reference_model.encode(texts, convert_to_numpy=True))


@pytest.mark.parametrize("backend", fast_loop_keeps(BACKENDS, ("sdpa", "varlen")))  # 2.5-5 s each
def test_every_attention_backend_from_the_folder(st_model, texts, backend):
    reference = st_model.encode(texts, convert_to_numpy=True)
    encoder = load_encoder(model_dir(), max_length=MAX_LENGTH, attention_backend=backend)
    assert encoder.normalize and encoder.model.pooling == ("mean",)
    for batching in ("packed", "sorted"):
        assert_same_vectors(
            encode(texts, encoder, batching=batching, batch_size=8, max_sequences_per_pack=8), reference
        )


def test_packed_encode_on_a_sentence_transformer_object(st_model, texts):
    reference = st_model.encode(texts, convert_to_numpy=True)
    assert_same_vectors(packed_encode(st_model, texts), reference)
    assert st_model._packed_encoder is not None  # built once, kept
    assert_same_vectors(packed_encode(st_model, texts[:3]), reference[:3])


def test_a_saved_folder_with_legacy_pooling_keys_is_read_as_written(st_model, texts, tmp_path):
    """A folder saved by sentence-transformers with CLS pooling and no Normalize, its
    pooling config rewritten in the legacy pooling_mode_* form older folders carry."""
    reference_model = with_pooling(st_model, "cls", False)
    reference_model.save(str(tmp_path / "st"))
    pooling_config = tmp_path / "st" / "1_Pooling" / "config.json"
    config = json.loads(pooling_config.read_text())
    config.pop("pooling_mode")
    config.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    pooling_config.write_text(json.dumps(config))
    spec = describe_embedding_folder(tmp_path / "st")
    assert (spec.task, spec.source, spec.max_sequence_length) == ("embedding", "modules.json", MAX_LENGTH)
    embedding = spec.embedding
    assert (embedding.pooling, embedding.normalize, embedding.lowercase) == (("cls",), False, False)
    assert embedding.default_prompt_name is None  # sentence-transformers saves empty prompts: no-ops
    encoder = load_encoder(tmp_path / "st")
    assert_same_vectors(encode(texts, encoder), reference_model.encode(texts, convert_to_numpy=True))


def test_chunks_and_order_do_not_change_a_vector(st_model, texts):
    encoder = load_encoder(model_dir(), max_length=MAX_LENGTH)
    whole = encode(texts, encoder)
    assert_same_vectors(encode(texts, encoder, chunk_texts=4), whole)
    order = np.random.default_rng(0).permutation(len(texts))
    np.testing.assert_allclose(encode([texts[i] for i in order], encoder), whole[order], atol=2e-6)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_command_writes_rows_in_line_order(st_model, texts, tmp_path, capsys):
    texts = [t for t in texts if t.strip()]  # the command refuses an empty text, as the server (below)
    source = write_jsonl(tmp_path / "texts.jsonl", texts)
    output = tmp_path / "out" / "embeddings.npy"
    argv = ["--model", str(model_dir()), "--input", str(source), "--output", str(output), "--quiet"]
    assert embed_command.main([*argv, "--max-length", str(MAX_LENGTH), "--chunk-texts", "5"]) == 0
    summary = json.loads(capsys.readouterr().out.strip())
    assert summary["texts"] == len(texts) and summary["dimension"] == 384
    assert (
        summary["truncated"]
        == sum(len(st_model.tokenize([t])["input_ids"][0]) >= MAX_LENGTH for t in texts)
        > 0
    )
    assert 0 < summary["real_token_fraction"] <= 1
    assert_same_vectors(np.load(output), st_model.encode(texts, convert_to_numpy=True))
    # the output and its lock (one run per output at a time), nothing half-written
    assert sorted(p.name for p in output.parent.iterdir()) == [".embeddings.npy.lock", "embeddings.npy"]


@pytest.mark.parametrize(
    "lines,message",
    [
        (['{"text": "fine"}', "", '{"text": "after"}'], ":2: blank line"),
        (
            ['{"text": "fine"}', '{"txt": "no field"}'],
            ":2: field 'text' is missing (the line's fields: 'txt')",
        ),
        (
            ['{"text": "fine"}', '{"text": "\\ud800x"}'],
            ":2: field 'text': not valid Unicode (a lone surrogate U+D800",
        ),
        (['{"text": 3}'], ":1: field 'text' must be a string"),
        (["not json"], ":1: not valid JSON"),
        (['{"text": "fine"}', '{"text": "  "}'], ":2: field 'text' is empty"),
    ],
)
def test_command_refuses_bad_lines_with_one_line_and_writes_nothing(tmp_path, capsys, lines, message):
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "embeddings.npy"
    argv = ["--model", str(model_dir()), "--input", str(source), "--output", str(output), "--quiet"]
    assert embed_command.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not [p for p in tmp_path.glob("*.npy*") if p.suffix != ".lock"] and not any(
        tmp_path.glob(".*tmp*")
    )


def test_command_refuses_bad_options(tmp_path, capsys):
    source = write_jsonl(tmp_path / "t.jsonl", ["a"])
    base = ["--model", str(model_dir()), "--input", str(source), "--quiet"]
    assert embed_command.main([*base, "--output", str(source)]) == 2  # over its input
    assert "also an input" in capsys.readouterr().err
    assert embed_command.main([*base, "--output", str(tmp_path / "o.npy"), "--max-length", "9999"]) == 2
    assert "3 to 512 tokens" in capsys.readouterr().err
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text((model_dir() / "config.json").read_text())
    assert embed_command.main([*base, "--output", str(tmp_path / "o.npy"), "--model", str(plain)]) == 2
    assert "give --pooling" in capsys.readouterr().err


def test_bfloat16_is_refused_where_the_cpu_has_no_bf16(tmp_path, capsys, monkeypatch):
    from packed_transformers.inference import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    source = write_jsonl(tmp_path / "t.jsonl", ["a"])
    argv = ["--model", str(model_dir()), "--input", str(source), "--output", str(tmp_path / "o.npy")]
    assert embed_command.main([*argv, "--dtype", "bfloat16"]) == 2
    assert "no bf16 instructions" in capsys.readouterr().err


@pytest.mark.slow
def test_bfloat16_autocast_agrees_with_float32(st_model, texts, monkeypatch):
    """Where bf16 runs (here forced past the hardware check, so that a CPU without bf16
    instructions emulates it), vectors stay close to fp32."""
    from packed_transformers.inference import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    encoder = load_encoder(model_dir(), max_length=MAX_LENGTH)
    fp32 = encode(texts, encoder)
    bf16 = encode(texts, encoder, options=InferenceOptions.for_embedding(dtype="bfloat16"))
    assert bf16.dtype == np.float32
    assert cosines(bf16, fp32).min() > 0.99


def test_a_plain_bert_folder_with_pooling(tmp_path, texts):
    """Any BERT folder pools as asked: CLS of the bare model's last layer."""
    from transformers import BertModel, BertTokenizerFast

    folder = tmp_path / "bert"
    bert = BertModel.from_pretrained(str(model_dir()), add_pooling_layer=False).eval()
    bert.save_pretrained(folder)
    BertTokenizerFast.from_pretrained(str(model_dir())).save_pretrained(folder)
    encoder = load_encoder(folder, pooling=["cls"], max_length=MAX_LENGTH)
    assert not encoder.normalize
    tokenizer = BertTokenizerFast.from_pretrained(str(folder))
    batch = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    with torch.no_grad():
        reference = bert(**batch).last_hidden_state[:, 0].numpy()
    assert_same_vectors(encode(texts, encoder), reference)
