"""`packed rerank` (commands/rerank.py, issue 109 item 3): a cross-encoder's scores of each query's
candidates, every pair packed, judged against sentence-transformers' `CrossEncoder.predict` per
pair (and transformers' logits with --raw-scores), through torch and through an exported folder;
mistakes in the input or the folder are one line, exit 2, nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packed_transformers.commands import export as export_command
from packed_transformers.commands import rerank

from ..family_helpers import save_family_folder

QUERIES = [
    ("market shares fall", ["the bank reported a profit", "a film won an award at the festival", "shares fell sharply",
                            "team wins the cup final after extra time and penalties in a long match"]),
    ("election vote", ["the vote was close", "music star", "parliament debated the election results for hours"]),
    ("film", ["a film", "the director's new film opened", "profit", "goal", "the band toured", "vote"]),
]  # fmt: skip


@pytest.fixture(scope="module", params=["bert", "roberta"])
def reranker(request, tmp_path_factory):
    """A one-label sequence-classification folder of the family (a cross-encoder), random, seed 0."""
    folder = tmp_path_factory.mktemp("reranker") / request.param
    return save_family_folder(folder, request.param, "classification", num_labels=1, id2label={0: "score"})


def write_queries(path, queries=QUERIES):
    path.write_text("".join(json.dumps({"query": q, "texts": t}) + "\n" for q, t in queries))
    return path


def test_scores_equal_cross_encoders_per_pair_and_rank_them(reranker, tmp_path):
    from sentence_transformers import CrossEncoder

    source, out = write_queries(tmp_path / "q.jsonl"), tmp_path / "scores.jsonl"
    assert rerank.main(["--model", str(reranker), "--input", str(source), "--output", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    judge = CrossEncoder(str(reranker), device="cpu")
    for i, ((query, texts), line) in enumerate(zip(QUERIES, lines)):
        expected = judge.predict([(query, text) for text in texts])  # sigmoid of the one logit
        assert line["index"] == i
        np.testing.assert_allclose(line["scores"], expected, rtol=0, atol=1e-5)
        assert line["ranking"] == [int(j) for j in np.argsort(-np.asarray(line["scores"]), kind="stable")]
    raw = tmp_path / "raw.jsonl"
    assert (
        rerank.main(["--model", str(reranker), "--input", str(source), "--output", str(raw), "--raw-scores"])
        == 0
    )
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reranker).eval()
    tokenizer = AutoTokenizer.from_pretrained(reranker)
    query, texts = QUERIES[0]
    with torch.no_grad():
        logits = model(**tokenizer([query] * len(texts), texts, return_tensors="pt", padding=True)).logits[
            :, 0
        ]
    np.testing.assert_allclose(
        json.loads(raw.read_text().splitlines()[0])["scores"], logits.numpy(), atol=1e-5
    )


def test_an_exported_reranker_scores_as_the_folder_does(reranker, tmp_path):
    """The torch-free folder (`packed export` of the cross-encoder) ranks alike."""
    pytest.importorskip("onnxruntime")
    exported = tmp_path / "exported"
    assert export_command.main(["--model", str(reranker), "--output", str(exported)]) == 0
    source = write_queries(tmp_path / "q.jsonl")
    for model, out in ((reranker, tmp_path / "a.jsonl"), (exported, tmp_path / "b.jsonl")):
        assert rerank.main(["--model", str(model), "--input", str(source), "--output", str(out)]) == 0
    for a, b in zip(*(p.read_text().splitlines() for p in (tmp_path / "a.jsonl", tmp_path / "b.jsonl"))):
        np.testing.assert_allclose(json.loads(a)["scores"], json.loads(b)["scores"], atol=1e-5)


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"query": "q"}', "field 'texts' is missing"),
        ('{"query": "q", "texts": []}', "field 'texts' must be a list of 1 to"),
        ('{"query": "q", "texts": "one text"}', "field 'texts' must be a list"),
        ('{"query": "q", "texts": ["a", 3]}', "field 'texts'[1]"),
        ('{"query": "", "texts": ["a"]}', "field 'query'"),
        ('{"query": "q", "texts": ["a"]', "not valid JSON"),
    ],
)
def test_a_bad_line_is_one_line_before_the_model_loads(tmp_path, capsys, line, says):
    source = tmp_path / "q.jsonl"
    source.write_text(json.dumps({"query": "fine", "texts": ["a"]}) + "\n" + line + "\n")
    out = tmp_path / "s.jsonl"
    # the folder is not even there: the input's mistake is said first
    assert (
        rerank.main(["--model", str(tmp_path / "no-model"), "--input", str(source), "--output", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{source}:2: " in err and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl"]


def test_a_folder_that_is_not_a_cross_encoder_and_an_existing_output_are_refused(tmp_path, capsys):
    three = save_family_folder(tmp_path / "three", "bert", "classification")  # 3 labels
    source = write_queries(tmp_path / "q.jsonl")
    out = tmp_path / "s.jsonl"
    assert rerank.main(["--model", str(three), "--input", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        "a classification folder of 3 labels; packed rerank runs a one-label" in err and err.count("\n") == 1
    )
    out.write_text("mine")
    assert rerank.main(["--model", str(three), "--input", str(source), "--output", str(out)]) == 2
    assert "give --overwrite" in capsys.readouterr().err and out.read_text() == "mine"
