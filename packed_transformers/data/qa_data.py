"""Extractive question answering data (SQuAD v1.1 / v2.0): read and check the questions.

Accepted layouts (recognised from the file's first non-blank character):
  official  SQuAD's nested JSON: {"data": [{"title", "paragraphs": [{"context",
            "qas": [{"id", "question", "answers": [{"text", "answer_start"}],
            "is_impossible" (v2.0, optional)}]}]}]}
  flat      JSON lines in the `datasets` layout: {"id", "question", "context",
            "answers": {"text": [...], "answer_start": [...]}} ("title" optional)

Every question is checked before anything is tokenized; a bad one is one error naming the
file, the question id (or line) and the field: an empty question or context, a duplicate
id, an answer whose text is not at its answer_start. Answers may be absent (prediction
input) or empty lists (v2.0's unanswerable questions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from packed_transformers.common import json_text
from packed_transformers.data.classification_data import ExampleError, check_readable
from packed_transformers.data.text_rule import check_text


@dataclass
class QaExamples:
    """Questions in input order. answers[i] = (texts, character starts) or None when the
    file gives none; where[i] names the file and question for error messages."""

    ids: list[str] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)
    contexts: list[str] = field(default_factory=list)
    answers: list[tuple[list[str], list[int]] | None] = field(default_factory=list)
    where: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def has_answers(self) -> bool:
        return bool(self.ids) and all(a is not None for a in self.answers)

    def subset(self, indices) -> QaExamples:
        pick = [int(i) for i in indices]
        return QaExamples(*([getattr(self, name)[i] for i in pick] for name in QaExamples.FIELDS))

    FIELDS = ("ids", "questions", "contexts", "answers", "where")


def read_squad(path) -> QaExamples:
    """Read an official SQuAD JSON file or a flat JSON-lines file; every question checked."""
    path = Path(path)
    check_readable(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ExampleError(f"{path}: not UTF-8 ({err.reason} at byte {err.start})") from None
    stripped = text.lstrip()
    if not stripped:
        raise ExampleError(f"{path}: no questions (empty file)")
    out = QaExamples()
    document = _one_document(stripped)
    if isinstance(document, dict) and "data" in document:
        _read_official(path, document, out)
    else:
        _read_flat(path, text, out)
    if not out.ids:
        raise ExampleError(f"{path}: no questions")
    seen: dict[str, str] = {}
    for qid, where in zip(out.ids, out.where):
        if qid in seen:
            raise ExampleError(f"{where}: field 'id': duplicate id {qid!r} (first at {seen[qid]})")
        seen[qid] = where
    return out


def _one_document(text: str):
    """The file as one JSON value, or None when it is not one (JSON lines, bad JSON)."""
    if not text.startswith("{"):
        return None
    try:
        return json_text.loads(text)
    except json.JSONDecodeError:
        return None


def _read_official(path: Path, document: dict, out: QaExamples) -> None:
    articles = document["data"]
    if not isinstance(articles, list):
        raise ExampleError(f"{path}: field 'data' must be a list of articles")
    for a, article in enumerate(articles):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise ExampleError(f"{path}: data[{a}]: field 'paragraphs' must be a list")
        for p, paragraph in enumerate(paragraphs):
            where_paragraph = f"{path}: data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("qas"), list):
                raise ExampleError(f"{where_paragraph}: field 'qas' must be a list")
            for qa in paragraph["qas"]:
                if not isinstance(qa, dict):
                    raise ExampleError(f"{where_paragraph}: every entry of 'qas' must be an object")
                answers = qa.get("answers")
                if qa.get("is_impossible"):
                    answers = []
                if isinstance(answers, list):
                    try:
                        answers = {
                            "text": [item["text"] for item in answers],
                            "answer_start": [item["answer_start"] for item in answers],
                        }
                    except (TypeError, KeyError):
                        answers = "malformed"
                _add(
                    out, qa.get("id"), qa.get("question"), paragraph.get("context"), answers, where_paragraph
                )


def _read_flat(path: Path, text: str, out: QaExamples) -> None:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where_line = f"{path}:{number}"
        try:
            record = json_text.loads(line)
        except json.JSONDecodeError as err:
            raise ExampleError(
                f"{where_line}: not valid JSON ({err.msg}); expected SQuAD JSON or JSON lines"
            ) from None
        if not isinstance(record, dict):
            raise ExampleError(f"{where_line}: expected a JSON object, got {type(record).__name__}")
        _add(
            out,
            record.get("id"),
            record.get("question"),
            record.get("context"),
            record.get("answers"),
            where_line,
        )


def _add(out: QaExamples, qid, question, context, answers, where_prefix: str) -> None:
    if not isinstance(qid, str | int) or isinstance(qid, bool) or str(qid) == "":
        raise ExampleError(f"{where_prefix}: field 'id' must be a non-empty string, got {qid!r}")
    qid = str(qid)
    where = f"{where_prefix}: question {qid!r}"
    for name, value in (("question", question), ("context", context)):
        check_text(value, f"{where}: field '{name}'")
    parsed = None
    if answers is not None:
        if not isinstance(answers, dict) or not isinstance(answers.get("text"), list):
            raise ExampleError(
                f"{where}: field 'answers' must be {{'text': [...], 'answer_start': [...]}} "
                f"(or a list of {{'text', 'answer_start'}} in SQuAD JSON)"
            )
        texts, starts = answers["text"], answers.get("answer_start")
        if not isinstance(starts, list) or len(starts) != len(texts):
            raise ExampleError(
                f"{where}: field 'answers': 'text' and 'answer_start' must be lists of one length"
            )
        for text, start in zip(texts, starts):
            if (
                not isinstance(text, str) or not text or not isinstance(start, int) or isinstance(start, bool)
                or start < 0  # a negative start would slice from the context's end
            ):  # fmt: skip
                raise ExampleError(
                    f"{where}: field 'answers': expected non-empty text and an integer answer_start >= 0, "
                    f"got {text!r:.60} at {start!r}"
                )
            if context[start : start + len(text)] != text:
                raise ExampleError(
                    f"{where}: field 'answers': the text {text!r:.60} is not at answer_start {start} of the "
                    f"context (found {context[start : start + len(text)]!r:.60})"
                )
        parsed = (list(texts), list(starts))
    out.ids.append(qid)
    out.questions.append(question)
    out.contexts.append(context)
    out.answers.append(parsed)
    out.where.append(where)
