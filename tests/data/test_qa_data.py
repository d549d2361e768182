"""SQuAD input (both layouts, every refusal) and windows by the reference's rules."""

import json

import numpy as np
import pytest

from packed_transformers.data import assets
from packed_transformers.data.classification_data import ExampleError
from packed_transformers.data.qa_cloze import build
from packed_transformers.data.qa_data import read_squad
from packed_transformers.data.qa_windows import fast_tokenizer, make_windows
from packed_transformers.data.tokenizer import load_tokenizer

CONTEXT = "Super Bowl 50 was played in Santa Clara, California. The Denver Broncos won."
QUESTIONS = [
    {"id": "q1", "question": "  Where was it played?", "context": CONTEXT,
     "answers": {"text": ["Santa Clara"], "answer_start": [28]}},
    {"id": "q2", "question": "Who won?", "context": CONTEXT,
     "answers": {"text": ["Denver Broncos", "The Denver Broncos"], "answer_start": [57, 53]}},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return fast_tokenizer(load_tokenizer(assets.vocab_file())[1])


def write_flat(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_official(path, records, version="1.1"):
    """SQuAD's nested layout, one paragraph per record; a record's missing keys stay missing."""
    paragraphs = []
    for r in records:
        qa = {key: r[key] for key in ("id", "question") if key in r}
        qa["answers"] = [
            {"text": t, "answer_start": s} for t, s in zip(r["answers"]["text"], r["answers"]["answer_start"])
        ]
        paragraphs.append({"context": r["context"], "qas": [qa]})
    path.write_text(json.dumps({"version": version, "data": [{"title": "t", "paragraphs": paragraphs}]}))
    return path


def test_both_layouts_read_the_same_questions(tmp_path):
    flat = read_squad(write_flat(tmp_path / "q.jsonl", QUESTIONS))
    official = read_squad(write_official(tmp_path / "q.json", QUESTIONS))
    for field in ("ids", "questions", "contexts", "answers"):
        assert getattr(flat, field) == getattr(official, field)
    assert flat.answers[1] == (["Denver Broncos", "The Denver Broncos"], [57, 53])


def test_v2_unanswerable_questions_read_as_empty_answers(tmp_path):
    document = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": CONTEXT, "qas": [
        {"id": "n1", "question": "Who lost?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "Carolina", "answer_start": 0}]}]}]}]}  # fmt: skip
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(document))
    assert read_squad(path).answers == [([], [])]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda r: r.update(answers={"text": ["Santa Clara"], "answer_start": [27]}),
            "not at answer_start 27",
        ),
        (lambda r: r.update(context="  "), "field 'context' is empty"),
        (lambda r: r.update(question=""), "field 'question' is empty"),
        (lambda r: r.update(id="q2"), "field 'id': duplicate id 'q2'"),
        (
            lambda r: r.update(answers={"text": ["x"]}),
            "'text' and 'answer_start' must be lists of one length",
        ),
        (lambda r: r.pop("id"), "field 'id' must be a non-empty string"),
        # "won" does sit at -4 from the end: a negative start must not slice from the end
        (lambda r: r.update(answers={"text": ["won"], "answer_start": [-4]}), "answer_start >= 0"),
        (lambda r: r.update(answers={"text": ["Houston"], "answer_start": [28]}), "not at answer_start 28"),
        (lambda r: r.update(answers={"text": ["Santa"], "answer_start": [500]}), "not at answer_start 500"),
        (lambda r: r.update(context="Santa \ud800 Clara"), "field 'context': not valid Unicode"),
    ],
)
@pytest.mark.parametrize("layout", ["flat", "official"])
def test_bad_questions_are_refused_naming_file_question_and_field(tmp_path, change, message, layout):
    if layout == "official" and "one length" in message:
        pytest.skip("the official layout pairs text and answer_start in one object")
    records = [dict(r) for r in QUESTIONS]
    change(records[0])
    path = (write_flat if layout == "flat" else write_official)(tmp_path / f"bad.{layout}", records)
    with pytest.raises(ExampleError) as err:
        read_squad(path)
    text = str(err.value)
    assert message in text and str(path) in text
    if "'id' must be" not in message:
        assert "question 'q" in text  # the question id is named


def test_a_question_too_long_for_its_window_is_refused(tmp_path, tokenizer):
    record = dict(QUESTIONS[0], question="why " * 60)
    examples = read_squad(write_flat(tmp_path / "long.jsonl", [record]))
    with pytest.raises(ExampleError, match=r"question 'q1': field 'question': 60 tokens.*at most 44"):
        make_windows(examples, tokenizer, max_sequence_length=64, doc_stride=16)


def reference_windows(examples, tokenizer, max_length, stride):
    """The reference's prepare_train_features (run_qa.py), loop for loop, on unpadded
    features: the judge of our windows and labels."""
    encoded = tokenizer(
        [q.lstrip() for q in examples.questions],
        examples.contexts,
        truncation="only_second",
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    labels = []
    for i, offsets in enumerate(encoded["offset_mapping"]):
        input_ids = encoded["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id)
        sequence_ids = encoded.sequence_ids(i)
        answers = examples.answers[encoded["overflow_to_sample_mapping"][i]]
        start_char = answers[1][0]
        end_char = start_char + len(answers[0][0])
        token_start_index = 0
        while sequence_ids[token_start_index] != 1:
            token_start_index += 1
        token_end_index = len(input_ids) - 1
        while sequence_ids[token_end_index] != 1:
            token_end_index -= 1
        if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
            labels.append((cls_index, cls_index))
            continue
        while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
            token_start_index += 1
        start = token_start_index - 1
        while offsets[token_end_index][1] >= end_char:
            token_end_index -= 1
        labels.append((start, token_end_index + 1))
    return encoded, labels


def test_windows_and_labels_follow_the_reference_on_real_text(tokenizer):
    """BBC cloze questions in windows of 96 tokens, stride 32 (many overflow windows).
    One known difference: when an answer starts in a window's last context token, the
    reference's forward walk runs on into [SEP] (offset (0, 0) <= start) and labels the
    [SEP]; ours labels the context token. Those windows are counted and checked apart."""
    files = sorted(__import__("glob").glob(assets.corpus_glob()))[:300]
    train, dev, _ = build(
        [__import__("pathlib").Path(f) for f in files], seed=1, per_article=4, dev_fraction=0.5
    )
    from packed_transformers.data.qa_data import QaExamples

    records = train + dev
    examples = QaExamples(
        [r["id"] for r in records], [r["question"] for r in records], [r["context"] for r in records],
        [(r["answers"]["text"], r["answers"]["answer_start"]) for r in records], [r["id"] for r in records],
    )  # fmt: skip
    ours = make_windows(examples, tokenizer, 96, 32)
    encoded, labels = reference_windows(examples, tokenizer, 96, 32)
    assert len(ours) == len(encoded["input_ids"]) > len(examples)
    assert ours.example_of_window.tolist() == list(encoded["overflow_to_sample_mapping"])
    walked_into_sep = 0
    for w, (ids, (start, end)) in enumerate(zip(encoded["input_ids"], labels)):
        assert ours.token_ids[w].tolist() == ids
        assert ours.segment_ids[w].tolist() == encoded["token_type_ids"][w]
        context = np.array([s == 1 for s in encoded.sequence_ids(w)])
        assert (ours.offsets[w][:, 0] >= 0).tolist() == context.tolist()
        if start == len(ids) - 1 and ids[start] == tokenizer.sep_token_id:
            walked_into_sep += 1
            assert ours.labels[w, 0] == np.flatnonzero(context)[-1]  # the last context token
            continue
        assert tuple(ours.labels[w]) == (start, end), w
    assert walked_into_sep < len(ours) // 50  # the edge case is rare
    # The labelled span decodes to the answer (uncased WordPiece), where a window holds it.
    inside = np.flatnonzero(ours.labels[:, 0] > 0)
    assert len(inside) > len(examples) // 2
    for w in inside[:200]:
        q = ours.example_of_window[w]
        first, last = ours.labels[w]
        text = examples.contexts[q][ours.offsets[w][first, 0] : ours.offsets[w][last, 1]]
        assert examples.answers[q][0][0] in text
