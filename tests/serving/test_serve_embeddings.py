"""The server's embedding and reranking routes on 127.0.0.1 (real uvicorn): TEI's /embed
and /rerank, OpenAI's /v1/embeddings.

Answers must equal `inference.embedding.encode` (what `python -m packed_transformers.finetune.embed` writes) for
concurrent clients, in request order, under every policy; /rerank must equal transformers'
BertForSequenceClassification on the (query, text) pairs; bad input gets a one-line 4xx,
never a 500."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from packed_transformers.data.assets import corpus_glob, model_dir
from packed_transformers.data.embedding_texts import bbc_articles, texts_of
from packed_transformers.inference.embedding import encode, l2_normalize, load_encoder
from packed_transformers.serving.api import RequestLimits
from packed_transformers.serving.policies import POLICIES

from ..servers import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def texts():
    return texts_of(bbc_articles(corpus_glob())[:2], "mixed")[:24]


@pytest.fixture(scope="module")
def expected(texts):
    """Pooled (not normalized) vectors and normalized ones, as the command computes them."""
    encoder = load_encoder(model_dir(), normalize=False)
    raw = encode(texts, encoder)
    return raw, l2_normalize(raw)


def send_concurrently(url, groups, body_of):
    def send(group):
        response = httpx.post(url, json=body_of(group), timeout=60)
        assert response.status_code == 200, response.text
        return group, response.json()

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(send, groups))


def groups_of(n, seed=0):
    cuts = np.cumsum(np.random.default_rng(seed).integers(1, 5, size=n))
    return [list(range(a, min(b, n))) for a, b in zip([0, *cuts], cuts) if a < n]


@pytest.mark.parametrize("policy", POLICIES)
def test_embed_and_openai_answers_equal_the_command_in_request_order(texts, expected, policy):
    raw, normalized = expected
    groups = groups_of(len(texts))
    with Server(model_dir(), policy, max_batch_tokens=512, batch_size=4) as server:
        for group, answer in send_concurrently(
            server.url + "/embed", groups, lambda g: {"inputs": [texts[i] for i in g]}
        ):
            np.testing.assert_allclose(np.array(answer, dtype=np.float32), normalized[group], atol=2e-5)
        for group, answer in send_concurrently(
            server.url + "/embed", groups, lambda g: {"inputs": [texts[i] for i in g], "normalize": False}
        ):
            np.testing.assert_allclose(np.array(answer, dtype=np.float32), raw[group], atol=5e-5)
        for group, answer in send_concurrently(
            server.url + "/v1/embeddings", groups, lambda g: {"input": [texts[i] for i in g], "model": "m"}
        ):
            assert answer["object"] == "list" and answer["model"] == "model"
            assert [d["index"] for d in answer["data"]] == list(range(len(group)))
            vectors = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
            np.testing.assert_allclose(vectors, normalized[group], atol=2e-5)
            assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 2 * len(group)
        metrics = httpx.get(server.url + "/metrics").text
        assert 'packed_requests_total{status="500"}' not in metrics


def test_single_string_base64_and_dimensions(texts, expected):
    _, normalized = expected
    with Server(model_dir()) as server:
        one = httpx.post(server.url + "/embed", json={"inputs": texts[0]}).json()
        assert len(one) == 1 and len(one[0]) == 384  # TEI: a list of embeddings even for one string
        np.testing.assert_allclose(one[0], normalized[0], atol=2e-5)
        body = {"input": texts[1], "encoding_format": "base64", "dimensions": 64}
        answer = httpx.post(server.url + "/v1/embeddings", json=body).json()
        decoded = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, l2_normalize(normalized[1:2, :64])[0], atol=2e-5)
        info = httpx.get(server.url + "/info").json()
        assert info["task"] == "embedding" and info["dimension"] == 384 and info["max_input_length"] == 256


BAD_EMBED = [
    ({"inputs": []}, 422, "batch is empty"),
    ({"inputs": [1, 2]}, 422, "must be a string"),
    ({"inputs": "\ud800x"}, 422, "not valid Unicode"),
    ({"inputs": ["ok", "\udfffend"]}, 422, "inputs[1]: not valid Unicode"),
    ({"inputs": ["a"] * 33}, 413, "at most 32 per request"),
    ({"inputs": "word " * 400}, 413, "the model takes at most 256"),
    ({"inputs": "a", "normalize": "yes"}, 422, '"normalize"'),
    ({"inputs": "a", "truncation_direction": "up"}, 422, "truncation_direction"),
    ({"input": "a"}, 422, 'field "inputs"'),
]
BAD_OPENAI = [
    ({"input": []}, 422, 'field "input": the batch is empty'),
    ({"input": "word " * 400}, 413, "input[0]: 402 tokens; the model takes at most 256"),
    ({"input": [[101, 102]]}, 422, "must be a string"),
    ({"input": "a", "encoding_format": "int8"}, 422, "encoding_format"),
    ({"input": "a", "dimensions": 0}, 422, "dimensions"),
    ({"input": "a", "dimensions": 385}, 422, "dimensions"),
    ({"input": "\ud800"}, 422, "not valid Unicode"),
]


def test_bad_requests_get_one_line_4xx_and_the_server_keeps_serving(texts):
    with Server(model_dir(), limits=RequestLimits(max_inputs=32)) as server:
        for body, status, message in BAD_EMBED:
            # json.dumps keeps a lone surrogate as the escape "\ud800": valid JSON, invalid Unicode
            response = httpx.post(
                server.url + "/embed", content=json.dumps(body), headers={"content-type": "application/json"}
            )
            assert response.status_code == status and message in response.json()["error"], (
                body,
                response.text,
            )
            assert "\n" not in response.json()["error"]
        for body, status, message in BAD_OPENAI:
            response = httpx.post(server.url + "/v1/embeddings", content=json.dumps(body))
            error = response.json()["error"]
            assert response.status_code == status and message in error["message"], (body, response.text)
            assert error["type"] == "invalid_request_error"
            assert "truncate" not in error["message"]  # OpenAI's API has no such field
        cut = httpx.post(server.url + "/embed", json={"inputs": "word " * 400, "truncate": True})
        assert cut.status_code == 200
        left = httpx.post(server.url + "/embed", json={"inputs": "word " * 400 + "end", "truncate": True,
                                                      "truncation_direction": "Left"})  # fmt: skip
        assert left.status_code == 200 and left.json() != cut.json()
        assert httpx.post(server.url + "/predict", json={"inputs": "a"}).status_code == 404
        assert httpx.post(server.url + "/embed", json={"inputs": texts[0]}).status_code == 200
        assert 'packed_requests_total{status="500"}' not in httpx.get(server.url + "/metrics").text


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A one-label classification folder (a cross-encoder's shape) in finetune.train's
    layout: MiniLM with a seeded single-logit head. Its weights need not be trained for the
    scores to be compared with transformers' on the same folder."""
    from packed_transformers.finetune.folder_writer import save_finetuned
    from packed_transformers.model.bert_heads import PackedBertForSequenceClassification

    torch.manual_seed(0)
    model = PackedBertForSequenceClassification.from_pretrained(
        model_dir(), new_head=True, num_labels=1, problem_type="multi_label_classification"
    )
    folder = tmp_path_factory.mktemp("cross") / "model"
    config = {
        "data": {"task": "classification", "multi_label": True, "max_sequence_length": 128, "too_long": "truncate",
                 "text_field": "text", "pair_field": "text_pair", "label_field": "label"},
        "batching": {"pack_length": 128},
    }  # fmt: skip
    save_finetuned(model, config, ["relevant"], model_dir() / "vocab.txt", folder)
    return folder


def test_rerank_scores_equal_transformers_best_first(cross_encoder, texts):
    from transformers import AutoTokenizer, BertForSequenceClassification

    query = texts[0]
    candidates = texts[1:9]
    reference = BertForSequenceClassification.from_pretrained(cross_encoder).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    batch = tokenizer([query] * len(candidates), candidates, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = reference(**batch).logits[:, 0].numpy()
    with Server(cross_encoder) as server:
        ranked = httpx.post(
            server.url + "/rerank", json={"query": query, "texts": candidates, "return_text": True}
        ).json()
        raw = httpx.post(
            server.url + "/rerank", json={"query": query, "texts": candidates, "raw_scores": True}
        ).json()
        bad = httpx.post(server.url + "/rerank", json={"query": query, "texts": []})
        assert httpx.post(server.url + "/embed", json={"inputs": "a"}).status_code == 404
    assert [r["index"] for r in ranked] == list(np.argsort(-logits, kind="stable"))
    np.testing.assert_allclose(
        [r["score"] for r in ranked], 1 / (1 + np.exp(-np.sort(logits)[::-1])), atol=1e-5
    )
    assert all(r["text"] == candidates[r["index"]] for r in ranked)
    np.testing.assert_allclose([r["score"] for r in raw], np.sort(logits)[::-1], atol=1e-4)
    assert bad.status_code == 422 and "empty" in bad.json()["error"]


def test_a_decoder_embedder_with_prompts_serves_what_sentence_transformers_encodes(tmp_path, texts):
    """Qwen3-Embedding's layout on a small random Qwen3: the tokenizer appends EOS, last-token
    pooling, Normalize, an instruction prompt in config_sentence_transformers.json. /embed and
    /v1/embeddings (with and without the prompt) equal SentenceTransformer.encode."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from ..decoder_helpers import decoder_tokenizer, tiny_config

    tokenizer = decoder_tokenizer()  # "<s> $A </s>": EOS appended, as Qwen3-Embedding's tokenizer does
    torch.manual_seed(0)
    transformers.AutoModel.from_config(tiny_config("qwen3", vocab_size=len(tokenizer))).save_pretrained(
        tmp_path / "q"
    )
    tokenizer.save_pretrained(tmp_path / "q")
    transformer = models.Transformer(str(tmp_path / "q"), max_seq_length=64)
    st_model = SentenceTransformer(
        modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), "lasttoken"), models.Normalize()],
        prompts={"query": "Instruct: find the article\nQuery: "}, device="cpu",
    )  # fmt: skip
    st_model.save(str(tmp_path / "st"))
    reloaded = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    short = [t[:40] for t in texts[:8]]
    plain = reloaded.encode(short, convert_to_numpy=True)
    query = reloaded.encode(short, prompt_name="query", convert_to_numpy=True)
    with Server(tmp_path / "st") as server:
        answer = httpx.post(server.url + "/v1/embeddings", json={"input": short, "model": "m"}).json()
        assert "data" in answer, answer
        got = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, plain, atol=2e-5)
        got = np.array(
            httpx.post(server.url + "/embed", json={"inputs": short, "prompt_name": "query"}).json()
        )
        np.testing.assert_allclose(got, query, atol=2e-5)
        assert np.abs(query - plain).max() > 1e-3  # the prompt made a difference
        # OpenAI's route takes prompt_name too (it was ignored: 200 with unprompted vectors)
        answer = httpx.post(
            server.url + "/v1/embeddings", json={"input": short, "prompt_name": "query"}
        ).json()
        got = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, query, atol=2e-5)
        for route, body in (("/v1/embeddings", {"input": short, "prompt_name": "nope"}),
                            ("/embed", {"inputs": short, "prompt_name": "nope"})):  # fmt: skip
            refused = httpx.post(server.url + route, json=body)
            assert refused.status_code == 422 and "prompt name 'nope'" in refused.text, refused.text
        for route, body in (("/v1/embeddings", {"input": short, "normalise": True}),
                            ("/embed", {"inputs": short, "normalise": False})):  # fmt: skip
            refused = httpx.post(server.url + route, json=body)
            assert refused.status_code == 422 and "normalise" in refused.text, refused.text
            assert "not a field of this route" in refused.text
