"""Folders as users bring them from the Hugging Face Hub: written by transformers'
save_pretrained (model + tokenizer.json), no finetune.json, no vocab.txt. predict and the
server take each as it is and answer what transformers computes on one example at a time
(no padding): a cased WordPiece classifier (single- and multi-label), a one-label
cross-encoder, a token-classification (NER) folder and a question-answering folder."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertTokenizerFast,
)

from packed_transformers.commands import predict
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.door.folder import load_finetuned

from ..conftest import PACKAGE
from ..folder_helpers import (  # noqa: F401
    TEXTS,
    save_hub_folder,
    tiny_config,
)

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TAGS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC"}


@pytest.fixture(scope="module")
def cased_tokenizer():
    """A cased WordPiece tokenizer learned once from the shipped BBC text (tokenizers' trainer;
    tests/fixtures/tokenizers/wordpiece-cased-1200.txt)."""
    from ..fixture_tokenizers import bert_vocabulary

    return BertTokenizerFast(
        vocab=bert_vocabulary("wordpiece-cased-1200.txt"), do_lower_case=False, model_max_length=96
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory, cased_tokenizer):
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    made = {}
    made["single"] = save_hub_folder(
        root / "single",
        BertForSequenceClassification(tiny_config(cased_tokenizer, num_labels=3, id2label=LABELS)),
        cased_tokenizer,
    )
    made["multi"] = save_hub_folder(
        root / "multi",
        BertForSequenceClassification(
            tiny_config(
                cased_tokenizer, num_labels=3, id2label=LABELS, problem_type="multi_label_classification"
            )
        ),
        cased_tokenizer,
    )
    made["cross"] = save_hub_folder(
        root / "cross",
        BertForSequenceClassification(tiny_config(cased_tokenizer, num_labels=1)),
        cased_tokenizer,
    )
    made["tokens"] = save_hub_folder(
        root / "tokens",
        BertForTokenClassification(tiny_config(cased_tokenizer, num_labels=4, id2label=TAGS)),
        cased_tokenizer,
    )
    made["qa"] = save_hub_folder(
        root / "qa", BertForQuestionAnswering(tiny_config(cased_tokenizer)), cased_tokenizer
    )
    return made


def one_at_a_time(model_class, folder, texts, pairs=None):
    """transformers' logits for each example alone (no padding), float64 for the comparison."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = model_class.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for i, text in enumerate(texts):
            encoded = tokenizer(text, pairs[i] if pairs else None, truncation=True, return_tensors="pt")
            out.append(model(**encoded).logits[0].double().numpy())
    return out


def run_predict(folder, records, tmp_path, *extra) -> list[dict]:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    # a test runs it more than once on one folder: each run replaces the last (predict refuses otherwise)
    argv = ["--model", str(folder), "--input", str(source), "--output", str(out), "--overwrite", *extra]
    assert predict.main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_a_cased_classifier_predicts_transformers_scores_per_example(folders, tmp_path, batching):
    pairs = [TEXTS[(i + 5) % len(TEXTS)] if i % 3 == 0 else None for i in range(len(TEXTS))]
    records = [{"text": t, **({"text_pair": p} if p else {})} for t, p in zip(TEXTS, pairs)]
    got = run_predict(folders["single"], records, tmp_path, "--batching", batching)
    expected = one_at_a_time(AutoModelForSequenceClassification, folders["single"], TEXTS, pairs)
    for record, logits in zip(got, expected):
        np.testing.assert_allclose(list(record["scores"].values()), softmax(logits), atol=1e-5)
        assert record["label"] == LABELS[int(np.argmax(logits))]
    # the folder's own (cased) tokenizer decides the ids: not a lower-cased vocab.txt
    loaded = load_finetuned(folders["single"])
    assert loaded.vocab is None and list(loaded.spec.labels) == list(LABELS.values())


def test_multi_label_and_a_one_label_cross_encoder_score_by_sigmoid(folders, tmp_path):
    got = run_predict(folders["multi"], [{"text": t} for t in TEXTS], tmp_path)
    for record, logits in zip(
        got, one_at_a_time(AutoModelForSequenceClassification, folders["multi"], TEXTS)
    ):
        scores = 1 / (1 + np.exp(-logits))
        np.testing.assert_allclose(list(record["scores"].values()), scores, atol=1e-5)
        assert record["labels"] == [LABELS[c] for c in np.flatnonzero(scores > 0.5)]
    queries = ["What did the company report?"] * len(TEXTS)
    got = run_predict(
        folders["cross"], [{"text": q, "text_pair": t} for q, t in zip(queries, TEXTS)], tmp_path
    )
    expected = one_at_a_time(AutoModelForSequenceClassification, folders["cross"], queries, TEXTS)
    np.testing.assert_allclose(
        [list(r["scores"].values())[0] for r in got], [1 / (1 + np.exp(-x[0])) for x in expected], atol=1e-5
    )


def test_token_classification_equals_the_pipelines_tokens(folders, tmp_path):
    from transformers import pipeline

    got = run_predict(folders["tokens"], [{"text": t} for t in TEXTS], tmp_path)
    stock = pipeline("token-classification", model=str(folders["tokens"]), device="cpu")(TEXTS)
    assert any(record["entities"] for record in got)
    for record, theirs in zip(got, stock):
        keys = ("entity", "index", "word", "start", "end")
        assert [tuple(e[k] for k in keys) for e in record["entities"]] == [
            tuple(e[k] for k in keys) for e in theirs
        ]
        np.testing.assert_allclose(
            [e["score"] for e in record["entities"]], [e["score"] for e in theirs], atol=1e-5
        )


def test_question_answering_logits_equal_transformers_per_window(folders):
    from packed_transformers.data.qa_data import QaExamples
    from packed_transformers.data.qa_windows import make_windows
    from packed_transformers.inference.question_answering import predict_spans
    from packed_transformers.packs.batching import Batcher, BatchingSpec

    loaded = load_finetuned(folders["qa"])
    assert loaded.spec.qa["max_answer_length"] == 15 and loaded.spec.max_sequence_length == 96
    n = 6
    examples = QaExamples(
        [str(i) for i in range(n)], [f"Who said {TEXTS[i].split()[0]}?" for i in range(n)],
        [" ".join(TEXTS[i : i + 4]) for i in range(n)], [None] * n, [f"q{i}" for i in range(n)],
    )  # fmt: skip
    windows = make_windows(examples, loaded.hf_tokenizer(), 96, 32)
    assert len(windows) > n  # contexts longer than a window: several windows per question
    spec = BatchingSpec("packed", 8, 96, 4, "lpfhp")
    start, end, _ = predict_spans(loaded.model, windows, Batcher(windows.lengths, spec, seed=0))
    reference = AutoModelForQuestionAnswering.from_pretrained(folders["qa"]).eval()
    with torch.no_grad():
        for w, (ids, segments) in enumerate(zip(windows.token_ids, windows.segment_ids)):
            out = reference(
                input_ids=torch.tensor([ids]).long(), token_type_ids=torch.tensor([segments]).long()
            )
            np.testing.assert_allclose(start[w, : len(ids)], out.start_logits[0].numpy(), atol=1e-5)
            np.testing.assert_allclose(end[w, : len(ids)], out.end_logits[0].numpy(), atol=1e-5)


# ----- the server -------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_server_answers_hub_folders_as_predict_under_concurrent_clients(folders, tmp_path):
    from ..servers import Server

    predicted = run_predict(folders["single"], [{"text": t} for t in TEXTS], tmp_path)
    with Server(folders["single"]) as server:

        def send(i):
            return i, httpx.post(
                server.url + "/predict", json={"inputs": [[t] for t in TEXTS[i : i + 3]]}, timeout=60
            )

        with ThreadPoolExecutor(6) as pool:
            for i, response in pool.map(send, range(0, len(TEXTS), 3)):
                assert response.status_code == 200, response.text
                for record, answer in zip(predicted[i : i + 3], response.json()):
                    by_label = {a["label"]: a["score"] for a in answer}
                    np.testing.assert_allclose(
                        [by_label[n] for n in LABELS.values()], list(record["scores"].values()), atol=1e-5
                    )
    cross = run_predict(
        folders["cross"], [{"text": "the market", "text_pair": t} for t in TEXTS[:8]], tmp_path
    )
    with Server(folders["cross"]) as server:
        ranked = httpx.post(
            server.url + "/rerank", json={"query": "the market", "texts": TEXTS[:8]}, timeout=60
        )
        assert ranked.status_code == 200, ranked.text
        for item in ranked.json():
            assert item["score"] == pytest.approx(list(cross[item["index"]]["scores"].values())[0], abs=1e-5)
    tags = run_predict(folders["tokens"], [{"text": t} for t in TEXTS], tmp_path)
    with Server(folders["tokens"]) as server:

        def tag(i):
            return i, httpx.post(server.url + "/tokens", json={"inputs": TEXTS[i : i + 4]}, timeout=60)

        with ThreadPoolExecutor(4) as pool:
            for i, response in pool.map(tag, range(0, len(TEXTS), 4)):
                assert response.status_code == 200, response.text
                for record, answer in zip(tags[i : i + 4], response.json()):
                    assert [(e["entity"], e["index"], e["start"]) for e in answer] == [
                        (e["entity"], e["index"], e["start"]) for e in record["entities"]
                    ]
        wrong = httpx.post(server.url + "/predict", json={"inputs": "a text"}, timeout=60)
        assert wrong.status_code == 404 and "/tokens" in wrong.json()["error"]
    with Server(folders["qa"]) as server:
        answer = httpx.post(
            server.url + "/qa", json={"inputs": {"question": "Who met?", "context": TEXTS[-1]}}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert TEXTS[-1][body["start"] : body["end"]] == body["answer"]


# ----- what cannot be run is refused in one line ----------------------------------------------
def refusal(folder) -> str:
    with pytest.raises(ExampleError) as refused:
        load_finetuned(folder)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_folders_that_cannot_run_are_refused_in_one_line(folders, tmp_path):
    assert "no such folder" in refusal(tmp_path / "runs" / "my_clasifier" / "model")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in refusal(empty)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (pickled / name).write_bytes((folders["single"] / name).read_bytes())
    torch.save({}, pickled / "pytorch_model.bin")
    assert re.search(r"pytorch_model.bin \(a pickle, which is never loaded here\)", refusal(pickled))
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    config = json.loads((folders["single"] / "config.json").read_text())
    (gpt / "config.json").write_text(json.dumps({**config, "model_type": "opt"}))
    assert "key 'model_type' is 'opt'" in refusal(gpt)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    assert "packed embed --pooling mean" in refusal(bare)


def test_only_the_runner_calls_the_model_in_inference():
    """The packed inference forward is written once (inference/torch_backend.py, the Runner's
    torch backend; the graph runtimes' backends call their sessions); training's one step
    (engines/torch_engine.py's take_step, every job's, beside BERT's evaluation) is the one other call, and the ONNX exporter's trace of the model (inference/onnx_graphs.py:
    tracing is a call, as openvino.convert_model's is inside OpenVINO) the other one."""
    callers = []
    rooms = (
        "inference",
        "finetune",
        "serving",
        "door",
        "ray_jobs",
        "hf_integration",
        "commands",
        "components",
        "engines",
    )
    for path in [p for room in rooms for p in sorted((PACKAGE / room).glob("*.py"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"model\(\*\*", line) and not line.lstrip().startswith(("#", "logits =")):
                callers.append(f"{path.relative_to(PACKAGE)}:{number}")
    assert sorted({c.split(":")[0] for c in callers}) == [
        "engines/torch_engine.py", "inference/onnx_graphs.py", "inference/torch_backend.py"
    ], callers  # fmt: skip
    assert sum(c.startswith("inference/onnx_graphs.py") for c in callers) == 2  # its output names, its trace


def test_server_engines_share_one_signature():
    """Routes hand every engine a serving.api.Request and take its answer; no route knows an
    engine's own arguments."""
    import inspect

    from packed_transformers.serving import engines

    classes = [engines.ClassificationEngine, engines.QaEngine, engines.TokenEngine, engines.EmbeddingEngine]
    for engine_class in classes:
        assert list(inspect.signature(engine_class.prepare).parameters) == ["self", "request"]
        assert list(inspect.signature(engine_class.answer).parameters) == ["self", "prepared", "outputs"]
        assert list(inspect.signature(engine_class.run).parameters) == [
            "self",
            "token_ids",
            "segment_ids",
            "table",
            "width",
        ]
