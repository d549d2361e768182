"""Extractive question answering as a fine-tuning task: SQuAD questions -> windows ->
batches in any mode -> packed QA model -> per-token logits -> answers -> SQuAD metrics.

    questions (data.qa_data.read_squad)
      -> windows, labels and offsets (data.qa_windows.make_windows)
      -> batch tables of windows (finetune.batching.Batcher: padded | dynamic | uniform | packed)
      -> rows (finetune.batching.collate) -> PackedBertForQuestionAnswering
      -> start/end logits per window (predict_spans) -> answers (finetune.qa_answers)
      -> {question id: answer} and EM / F1 (data.squad_metrics)

`finetune.train` runs the loop; this module holds what is particular to QA. A window is
the unit the model sees (what "examples/s" counts in training and inference), a question
the unit that is answered and scored.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.cli import first_line
from common.files import atomic_path
from data.qa_data import QaExamples, read_squad
from data.qa_windows import QaWindows, fast_tokenizer, make_windows
from data.squad_metrics import squad_scores
from finetune.batching import Batcher
from finetune.qa_answers import Answers, AnswerSettings, best_answers
from finetune.runner import Runner, per_token

log = logging.getLogger("finetune")


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


def check_answers_present(examples: QaExamples, version_2: bool, name: str) -> None:
    """Training and validation need gold answers; v1.1 needs at least one per question."""
    for answers, where in zip(examples.answers, examples.where):
        if answers is None:
            raise ValueError(f"{where}: field 'answers' is missing ({name} questions need gold answers)")
        if not answers[0] and not version_2:
            raise ValueError(
                f"{where}: field 'answers' is empty: an unanswerable question needs "
                f"qa.version_2_with_negative: true (SQuAD v2.0)"
            )


def prepare_qa(config: dict, vocab: dict, resolve) -> tuple[QaSplit, QaSplit, object]:
    """Read, check and window the train and validation questions -> (train, validation, tokenizer)."""
    from data.classification_data import ExampleError, split_by_seed

    data, qa = config["data"], config["qa"]
    tokenizer = fast_tokenizer(vocab)
    train = read_squad(resolve(data["train_file"]))
    if data["validation_file"] is None:
        train_rows, val_rows = split_by_seed(len(train), data["validation_fraction"], data["split_seed"])
        train, validation = train.subset(train_rows), train.subset(val_rows)
    else:
        validation = read_squad(resolve(data["validation_file"]))
    splits = []
    for name, examples in (("train", train), ("validation", validation)):
        try:
            check_answers_present(examples, qa["version_2_with_negative"], name)
        except ValueError as err:
            raise ExampleError(str(err)) from None
        windows = make_windows(examples, tokenizer, data["max_sequence_length"], qa["doc_stride"])
        log.info(
            "%s: %d questions -> %d windows of %d..%d tokens (%d questions span several windows)",
            name,
            len(examples),
            len(windows),
            windows.lengths.min(),
            windows.lengths.max(),
            int((np.bincount(windows.example_of_window) > 1).sum()),
        )
        splits.append(QaSplit(examples, windows))
    return splits[0], splits[1], tokenizer


def build_qa_model(config: dict, checkpoint: str):
    """The trainable QA head (a transformers PreTrainedModel: imported here, not with the
    module, which predict also imports to answer questions)."""
    from model.opening import ModelOptions, open_model

    model_cfg = config["model"]
    torch.manual_seed(config["training"]["seed"])  # qa_outputs' init
    options = ModelOptions(
        new_head=True,  # fine-tuning: qa_outputs may be new; the encoder must be whole
        attention_backend=model_cfg["attention_backend"],
        dropout={"hidden": model_cfg["hidden_dropout"], "attention": model_cfg["attention_dropout"]},
    )
    try:  # through the door, as every other task (its checks: strict weights, finite weights)
        return open_model(checkpoint, "question_answering", options).model
    except (OSError, ValueError, RuntimeError) as err:  # a missing, truncated or foreign folder
        from data.classification_data import ExampleError

        raise ExampleError(
            f"model.init_checkpoint {checkpoint}: cannot be loaded ({first_line(err)[:300]})"
        ) from None


def predict_spans(model, windows: QaWindows, batcher: Batcher) -> tuple[np.ndarray, np.ndarray, dict]:
    """Start and end logits float32 [W, longest window] in window order (-inf past each
    window's end), and the pass's timing and padding figures. `model`: a module (run on its
    own device) or a finetune.runner.Runner."""
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
