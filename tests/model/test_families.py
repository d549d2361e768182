"""Encoders beyond BERT, packed (model/families.py): every family x head equals transformers'
unpacked model per example (fp32 logits / hidden states <= 1e-5, gradients too), for any
pack layout (hypothesis); folders as save_pretrained writes them run through predict and
embed with their own tokenizers; sentence-transformers folders equal `encode`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packed_transformers.model.families import FAMILIES as PACKED
from packed_transformers.model.family_model import PackedFamilyModel
from packed_transformers.packs.rows import pack_rows
from packed_transformers.packs.tokenized import pack_examples

from ..conftest import REPO
from ..family_helpers import AUTO, FAMILIES, TASKS, TEXTS, family_tokenizer, save_family_folder

LOADED: dict = {}


def pair(tmp_path_factory, family: str, task: str):
    """(transformers' model, ours) over one saved folder, built once per family and task."""
    key = (family, task)
    if key not in LOADED:
        folder = save_family_folder(tmp_path_factory.mktemp(f"{family}-{task}"), family, task)
        reference = getattr(transformers, AUTO[task]).from_pretrained(folder).eval()
        LOADED[key] = (reference, PackedFamilyModel.from_pretrained(folder, task).eval(), folder)
    return LOADED[key]


def random_sequences(rng, lengths, vocab: int, with_types: bool):
    ids = [np.array([2, *rng.integers(5, vocab, n - 2), 3]) for n in lengths]
    types = [
        np.array([0] * (n // 2) + [1] * (n - n // 2)) if with_types else np.zeros(n, dtype=np.int64)
        for n in lengths
    ]
    return ids, types


def per_example(reference, task, ids, types, with_types):
    """transformers on each sequence alone: what the packed slot must equal."""
    out = []
    with torch.no_grad():
        for i, t in zip(ids, types):
            arguments = {"input_ids": torch.tensor([i])}
            if with_types:
                arguments["token_type_ids"] = torch.tensor([t])
            result = reference(**arguments)
            if task == "classification" or task == "token_classification":
                out.append(result.logits[0])
            elif task == "question_answering":
                out.append(torch.stack([result.start_logits[0], result.end_logits[0]], -1))
            else:
                out.append(result.last_hidden_state[0].mean(0))
    return out


def packed_outputs(ours, task, rows, table, lengths):
    with torch.no_grad():
        out = ours(**{k: torch.from_numpy(v) for k, v in rows.items()})
    got = [None] * len(lengths)
    for r, slots in enumerate(table):
        for s, i in enumerate(slots):
            if i < 0:
                continue
            first, n = rows["cls_positions"][r, s], lengths[i]
            if task == "classification":
                got[i] = out["logits"][r, s]
            elif task == "token_classification":
                got[i] = out["logits"][r, first : first + n]
            elif task == "question_answering":
                got[i] = torch.stack(
                    [out["start_logits"][r, first : first + n], out["end_logits"][r, first : first + n]], -1
                )
            else:
                got[i] = out["embeddings"][r, s]
    return got


def check_layout(reference, ours, task, lengths, k, seed):
    rng = np.random.default_rng(seed)
    ids, types = random_sequences(rng, lengths, ours.config.vocab_size, ours._token_types)
    width = max(64, max(lengths))
    table = pack_examples(np.array(lengths), width, k, "lpfhp", seed=seed)
    rows = pack_rows(ids, table, width, types)
    expected = per_example(reference, task, ids, types, ours._token_types)
    for a, b in zip(expected, packed_outputs(ours, task, rows, table, lengths)):
        torch.testing.assert_close(b.float(), a.float(), atol=1e-5, rtol=0)


CASES = [(f, t) for f in FAMILIES for t in TASKS if not (f == "nomic_bert" and t == "question_answering")]


@pytest.mark.parametrize("family, task", CASES)
def test_packed_equals_transformers_per_example(tmp_path_factory, family, task):
    reference, ours, _ = pair(tmp_path_factory, family, task)
    check_layout(reference, ours, task, [5, 17, 3, 30, 12, 9, 25, 2, 40], 4, seed=0)


@pytest.mark.parametrize("family", ["roberta", "modernbert", "deberta-v2", "mpnet", "distilbert"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(2, 60), min_size=1, max_size=12), k=st.integers(1, 6), seed=st.integers(0, 9)
)
def test_any_lengths_and_layout_give_the_same_per_sequence_outputs(
    tmp_path_factory, family, lengths, k, seed
):
    reference, ours, _ = pair(tmp_path_factory, family, "token_classification")
    check_layout(reference, ours, "token_classification", lengths, k, seed)


BUCKETED = [f for f in FAMILIES if PACKED[f].pair_mask is None]  # attend through model.causal_buckets


@pytest.mark.parametrize("family", BUCKETED)
def test_length_buckets_give_transformers_outputs_per_example(tmp_path_factory, family):
    """Attention by length buckets of 8, 16, ... tokens (what rows over MASK_MAX_LENGTH
    use; ModernBERT's local window of the tiny config acts inside them) equals transformers
    per example, as the mask path does."""
    reference, ours, _ = pair(tmp_path_factory, family, "token_classification")
    ours.attention_granularity = 8
    try:
        check_layout(reference, ours, "token_classification", [5, 17, 3, 30, 12, 9, 25, 2, 40], 4, seed=3)
    finally:
        ours.attention_granularity = None


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_the_unpacked_sum_of_losses(tmp_path_factory, family):
    """Training on packs: the summed per-sequence cross-entropy's gradients equal those of
    the same losses computed on each sequence alone."""
    reference, ours, _ = pair(tmp_path_factory, family, "classification")
    reference.train(), ours.train()  # dropout is 0 in these configs
    rng = np.random.default_rng(1)
    lengths = [7, 19, 4, 30, 11]
    ids, types = random_sequences(rng, lengths, ours.config.vocab_size, ours._token_types)
    labels = rng.integers(0, 3, len(lengths))
    table = pack_examples(np.array(lengths), 64, 3, "lpfhp", seed=0)
    rows = pack_rows(ids, table, 64, types)
    ours.zero_grad(), reference.zero_grad()
    logits = ours(**{k: torch.from_numpy(v) for k, v in rows.items()})["logits"]
    present = table >= 0
    target = torch.from_numpy(labels[np.where(present, table, 0)])
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    (losses * torch.from_numpy(present).flatten()).sum().backward()
    for i, (x, t) in enumerate(zip(ids, types)):
        arguments = {"input_ids": torch.tensor([x])}
        if ours._token_types:
            arguments["token_type_ids"] = torch.tensor([t])
        out = reference(**arguments).logits
        torch.nn.functional.cross_entropy(out, torch.tensor([labels[i]])).backward()
    mine = dict(ours.hf_model.named_parameters())
    for name, parameter in reference.named_parameters():
        if parameter.grad is None:
            continue
        torch.testing.assert_close(mine[name].grad, parameter.grad, atol=2e-5, rtol=1e-4, msg=name)
    reference.eval(), ours.eval()


# ----- folders through the commands ------------------------------------------------------------
@pytest.mark.parametrize(
    "family", ["roberta", "xlm-roberta", "modernbert", "deberta-v2", "electra", "distilbert"]
)
def test_predict_takes_a_family_folder_with_its_tokenizer(tmp_path, family):
    """A classifier folder as save_pretrained writes it: predict's scores equal
    AutoModelForSequenceClassification on each (text, pair) alone, tokenized by
    AutoTokenizer (the family's template, token types only where it has them)."""
    from packed_transformers.commands import predict

    folder = save_family_folder(tmp_path / "m", family, "classification")
    pairs = [TEXTS[(i + 3) % len(TEXTS)] if i % 2 else None for i in range(len(TEXTS))]
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(
            json.dumps({"text": t, **({"text_pair": p} if p else {})}) + "\n" for t, p in zip(TEXTS, pairs)
        )
    )
    assert (
        predict.main(["--model", str(folder), "--input", str(source), "--output", str(tmp_path / "p.jsonl")])
        == 0
    )
    got = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        for record, text, second in zip(got, TEXTS, pairs):
            logits = reference(**tokenizer(text, second, truncation=True, return_tensors="pt")).logits[0]
            np.testing.assert_allclose(
                list(record["scores"].values()), torch.softmax(logits, -1).numpy(), atol=1e-5
            )


def sentence_transformers_folder(root, family):
    from sentence_transformers import SentenceTransformer, models

    folder = save_family_folder(root / f"{family}-base", family, "embedding")
    transformer = models.Transformer(str(folder), max_seq_length=48)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), "mean")
    st_model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    st_folder = root / f"{family}-st"
    st_model.save(str(st_folder))
    return st_folder


@pytest.mark.parametrize("family", ["mpnet", "xlm-roberta", "modernbert"])
def test_sentence_transformers_folders_equal_encode(tmp_path, family):
    from sentence_transformers import SentenceTransformer

    from packed_transformers.inference.embedding import encode, load_encoder, packed_encode

    folder = sentence_transformers_folder(tmp_path, family)
    texts = TEXTS + [" ".join(TEXTS[:6])]  # one past max_seq_length: truncated as encode truncates
    st_model = SentenceTransformer(str(folder), device="cpu")
    expected = st_model.encode(texts, convert_to_numpy=True)
    for got in (encode(texts, load_encoder(folder)), packed_encode(st_model, texts)):
        cosine = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)
        assert cosine.min() >= 0.99999, cosine.min()
    # the SentenceTransformer object still encodes as before once packed_encode has used it
    np.testing.assert_allclose(st_model.encode(texts, convert_to_numpy=True), expected, atol=1e-6)


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_a_family_outside_the_list_is_refused_in_one_line(tmp_path):
    from transformers import OPTConfig, OPTModel

    folder = tmp_path / "opt"
    OPTModel(
        OPTConfig(num_hidden_layers=1, hidden_size=16, ffn_dim=32, num_attention_heads=2, vocab_size=50,
                  max_position_embeddings=32, word_embed_proj_dim=16)
    ).save_pretrained(folder)  # fmt: skip
    family_tokenizer("bert").save_pretrained(folder)
    texts = tmp_path / "t.jsonl"
    texts.write_text('{"text": "a text"}\n')
    done = subprocess.run(
        [sys.executable, "-m", "packed_transformers.finetune.embed", "--model", str(folder), "--pooling", "mean", "--input", str(texts),
         "--output", str(tmp_path / "e.npy")], cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert (
        "model_type 'opt' is not a packed model family (encoder or decoder); supported: bert, camembert"
        in last
    )
    assert "Traceback" not in done.stderr
    assert set(PACKED) >= set(FAMILIES)


@pytest.mark.slow
def test_the_server_answers_a_family_folder_as_predict_and_encode_under_concurrent_clients(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from packed_transformers.commands import predict
    from packed_transformers.inference.embedding import encode, l2_normalize, load_encoder

    from ..servers import Server

    folder = save_family_folder(tmp_path / "cls", "xlm-roberta", "classification")
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert (
        predict.main(["--model", str(folder), "--input", str(source), "--output", str(tmp_path / "p.jsonl")])
        == 0
    )
    expected = [
        list(json.loads(line)["scores"].values()) for line in (tmp_path / "p.jsonl").read_text().splitlines()
    ]
    with Server(folder) as server:

        def send(i):
            body = {"inputs": [[t] for t in TEXTS[i : i + 3]]}
            return i, httpx.post(server.url + "/predict", json=body, timeout=60)

        with ThreadPoolExecutor(6) as pool:
            for i, response in pool.map(send, range(0, len(TEXTS), 3)):
                assert response.status_code == 200, response.text
                for scores, answer in zip(expected[i : i + 3], response.json()):
                    by_label = {a["label"]: a["score"] for a in answer}
                    np.testing.assert_allclose([by_label[n] for n in "abc"], scores, atol=1e-5)
    st_folder = sentence_transformers_folder(tmp_path, "modernbert")
    vectors = l2_normalize(encode(TEXTS, load_encoder(st_folder)))
    with Server(st_folder) as server:

        def embed(i):
            return i, httpx.post(
                server.url + "/embed", json={"inputs": TEXTS[i : i + 4], "truncate": True}, timeout=60
            )

        with ThreadPoolExecutor(4) as pool:
            for i, response in pool.map(embed, range(0, len(TEXTS), 4)):
                assert response.status_code == 200, response.text
                np.testing.assert_allclose(np.array(response.json()), vectors[i : i + 4], atol=1e-5)


@pytest.mark.parametrize("family", ["roberta", "deberta-v2"])
def test_finetune_train_starts_from_a_family_folder_and_saves_one_transformers_loads(tmp_path, family):
    """finetune.train from a bare encoder folder of another family (its tokenizer.json, no
    vocab.txt): it learns, and its output loads in AutoModelForSequenceClassification, and
    predict on it equals transformers per example."""
    from packed_transformers.commands import predict
    from packed_transformers.finetune import train as finetune

    from ..finetune_helpers import write_config

    checkpoint = save_family_folder(tmp_path / "base", family, "embedding")
    config = write_config(tmp_path, checkpoint, training={"epochs": 3, "progress": False},
                          model={"hidden_dropout": 0.0, "attention_dropout": 0.0})  # fmt: skip
    assert finetune.main(["--config", str(config), "--output-dir", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["validation_accuracy"] > 0.5  # three topics of distinct words: learnable
    model_folder = tmp_path / "run" / "model"
    assert (model_folder / "tokenizer.json").is_file() and not (model_folder / "vocab.txt").exists()
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(model_folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_folder)
    source = tmp_path / "val.jsonl"
    assert (
        predict.main(
            ["--model", str(model_folder), "--input", str(source), "--output", str(tmp_path / "p.jsonl")]
        )
        == 0
    )
    records = [json.loads(line) for line in source.read_text().splitlines()]
    got = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    with torch.no_grad():
        for record, prediction in zip(records, got):
            encoded = tokenizer(record["text"], record.get("text_pair"), truncation=True, return_tensors="pt")
            logits = reference(**encoded).logits[0]
            np.testing.assert_allclose(
                list(prediction["scores"].values()), torch.softmax(logits, -1).numpy(), atol=1e-5
            )


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_sentence_transformers_prompts_are_applied_as_encode_applies_them(tmp_path):
    """e5-style prompts (config_sentence_transformers.json): the default prompt, a named one,
    through the Python API, the command and the server's /embed; an unknown name is one line."""
    import httpx
    from sentence_transformers import SentenceTransformer

    from packed_transformers.inference.embedding import encode, load_encoder, packed_encode

    from ..servers import Server

    folder = sentence_transformers_folder(tmp_path, "xlm-roberta")
    described = json.loads((folder / "config_sentence_transformers.json").read_text())
    described.update(prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="query")
    (folder / "config_sentence_transformers.json").write_text(json.dumps(described))
    st_model = SentenceTransformer(str(folder), device="cpu")
    encoder = load_encoder(folder)
    for name in (None, "passage"):
        expected = st_model.encode(TEXTS, prompt_name=name, convert_to_numpy=True)
        for got in (
            encode(TEXTS, encoder, prompt_name=name),
            packed_encode(st_model, TEXTS, prompt_name=name),
        ):
            cosine = (
                (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)
            )
            assert cosine.min() >= 0.99999
    source = tmp_path / "t.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    for argv, expected_name in ([[], None], [["--prompt-name", "passage"], "passage"]):
        done = subprocess.run(
            [sys.executable, "-m", "packed_transformers.finetune.embed", "--model", str(folder), "--input", str(source), "--output",
             str(tmp_path / "e.npy"), "--quiet", "--overwrite", *argv], cwd=REPO, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        np.testing.assert_allclose(
            np.load(tmp_path / "e.npy"), encode(TEXTS, encoder, prompt_name=expected_name), atol=1e-6
        )
    done = subprocess.run(
        [sys.executable, "-m", "packed_transformers.finetune.embed", "--model", str(folder), "--input", str(source), "--output",
         str(tmp_path / "x.npy"), "--prompt-name", "question"], cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "error: prompt name 'question': this model's prompts are passage, query"
    )
    with Server(folder) as server:
        answer = httpx.post(
            server.url + "/embed",
            json={"inputs": TEXTS[:3], "prompt_name": "passage", "truncate": True},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(
            np.array(answer.json()), encode(TEXTS[:3], encoder, prompt_name="passage"), atol=1e-5
        )
        wrong = httpx.post(
            server.url + "/embed", json={"inputs": TEXTS[:1], "prompt_name": "question"}, timeout=60
        )
        assert wrong.status_code == 422 and "prompts are passage, query" in wrong.json()["error"]


def test_mpnet_counts_positions_from_its_fixed_padding_index(tmp_path):
    """MPNet's embeddings number positions from a padding index fixed at 1 whatever the
    config's pad_token_id (found by bench/bench_families.py with BERT's ids, pad 0)."""
    from ..family_helpers import tiny_config

    tokenizer = family_tokenizer("bert")  # [PAD] = 0, as a BERT-vocabulary MPNet would have it
    torch.manual_seed(0)
    config = tiny_config("mpnet", tokenizer, "classification", pad_token_id=0)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    ours = PackedFamilyModel.from_pretrained(tmp_path, "classification").eval()
    check_layout(reference, ours, "classification", [5, 17, 3, 30], 3, seed=0)


def test_texts_longer_than_a_roberta_style_table_are_cut_to_its_usable_positions(tmp_path):
    """RoBERTa-style tables hold pad + 1 fewer positions than max_position_embeddings: a
    text past them is cut there by predict (finetune.train's folder format too) and by
    packed_pipeline, as transformers cuts it, never an index error."""
    from packed_transformers.commands import predict
    from packed_transformers.hf_integration.pipeline import packed_pipeline

    folder = save_family_folder(tmp_path / "m", "roberta", "classification")
    info = {"task": "classification", "labels": ["a", "b", "c"], "multi_label": False, "max_sequence_length": 32,
            "fields": {"text": "text", "pair": None, "label": None}, "tokenizer": "tokenizer.json"}  # fmt: skip
    (folder / "finetune.json").write_text(json.dumps(info))
    long_text = " ".join(TEXTS * 3)  # far past the 128 usable positions
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": long_text}) + "\n")
    assert (
        predict.main(["--model", str(folder), "--input", str(source), "--output", str(tmp_path / "p.jsonl")])
        == 0
    )
    got = list(json.loads((tmp_path / "p.jsonl").read_text())["scores"].values())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        encoded = tokenizer(long_text, truncation=True, max_length=128, return_tensors="pt")
        expected = torch.softmax(reference(**encoded).logits[0], -1).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)
    (folder / "finetune.json").unlink()
    answer = packed_pipeline("text-classification", model=folder)(long_text)
    assert answer["score"] == pytest.approx(float(expected.max()), abs=1e-5)
