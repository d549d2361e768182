"""Answering questions over their windows, as predict, the server and QA fine-tuning's
validation all do: windows -> batches -> the packed QA model through the runner -> start and
end logits per window -> answers (inference.qa_answers) -> SQuAD's files and metrics.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.files import atomic_path
from packed_transformers.data.qa_data import QaExamples
from packed_transformers.data.qa_windows import QaWindows
from packed_transformers.data.squad_metrics import squad_scores
from packed_transformers.inference.qa_answers import Answers, AnswerSettings, best_answers
from packed_transformers.inference.runner import Runner, per_token
from packed_transformers.packs.batching import Batcher


@dataclass
class QaSplit:
    """The questions of one split and their windows."""

    examples: QaExamples
    windows: QaWindows


def answer_settings(qa: dict, keep_nbest: bool = False) -> AnswerSettings:
    return AnswerSettings(
        qa["n_best_size"],
        qa["max_answer_length"],
        qa["version_2_with_negative"],
        qa["null_score_diff_threshold"],
        keep_nbest,
    )


def predict_spans(model, windows: QaWindows, batcher: Batcher) -> tuple[np.ndarray, np.ndarray, dict]:
    """Start and end logits float32 [W, longest window] in window order (-inf past each
    window's end), and the pass's timing and padding figures. `model`: a module (run on its
    own device) or a inference.runner.Runner."""
    runner = model if isinstance(model, Runner) else Runner(model)
    tables = batcher.epoch(0, shuffle=False)
    start_time = time.perf_counter()
    names = ("start_logits", "end_logits")
    batches = list(runner.run(windows.token_ids, tables, batcher.width, windows.segment_ids, names))
    seconds = time.perf_counter() - start_time
    start, end = (per_token(batches, name, windows.lengths) for name in names)
    return (
        start,
        end,
        {
            "examples": len(windows),
            "seconds": seconds,
            "examples_per_second": len(windows) / seconds,
            "batches": len(tables),
            "padding_fraction": batcher.padding_fraction(tables),
        },
    )


def offsets_table(windows: QaWindows, width: int) -> np.ndarray:
    """Per-window offsets stacked into int32 [W, width, 2], -1 past each window's end."""
    out = np.full((len(windows), width, 2), -1, dtype=np.int32)
    for w, spans in enumerate(windows.offsets):
        out[w, : len(spans)] = spans
    return out


def answer_questions(
    model, split: QaSplit, batcher: Batcher, settings: AnswerSettings
) -> tuple[Answers, dict]:
    """Inference over a split's windows, then one answer per question; timing figures."""
    start, end, timing = predict_spans(model, split.windows, batcher)
    began = time.perf_counter()
    answers = best_answers(
        start,
        end,
        offsets_table(split.windows, start.shape[1]),
        split.windows.example_of_window,
        split.examples.contexts,
        settings,
    )
    timing["postprocess_seconds"] = time.perf_counter() - began
    timing["questions"] = len(split.examples)
    return answers, timing


def score_answers(answers: Answers, examples: QaExamples, version_2: bool) -> dict:
    predictions = dict(zip(examples.ids, answers.text))
    gold = {qid: list(a[0]) for qid, a in zip(examples.ids, examples.answers)}
    return squad_scores(predictions, gold, version_2)


def write_answer_files(path: Path, answers: Answers, examples: QaExamples, nbest_path: Path | None = None):
    """The official predictions file {question id: answer text} (atomic), and optionally
    the n-best file {question id: [{text, probability, start_logit, end_logit}]}."""
    for target, content in (
        (path, dict(zip(examples.ids, answers.text))),
        (nbest_path, dict(zip(examples.ids, answers.nbest or []))),
    ):
        if target is None:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            tmp.write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
