"""Packed inference with transformers' pipeline interface: texts in, the pipeline's
output format out, in input order.

    classify = packed_pipeline("text-classification", model="runs/out")   # a saved folder
    classify(["first text", ("a text", "its pair"), ...])
        -> [{"label": "sport", "score": 0.93}, ...]            (top_k=None: every label)
    answer = packed_pipeline("question-answering", model=folder)
    answer([{"question": ..., "context": ...}, ...]) -> [{"answer", "score", "start", "end"}, ...]
    tag = packed_pipeline("token-classification", model=folder)
    tag(["a sentence", ...]) -> [[{"entity", "score", "index", "word", "start", "end"}, ...], ...]

Inputs are tokenized without padding, packed (packs.tokenized.pack_examples) and run
in batches of packs; outputs return to input order through each slot's example index.
Scores follow transformers' pipelines: softmax for single-label classification, sigmoid
for multi-label (problem_type multi_label_classification) and one-label models; QA answers
are chosen by the reference post-processing (inference.qa_answers), the same as
`python -m packed_transformers.finetune.predict`; token classification reports every token whose label is
not in ignore_labels ("O"), special tokens left out, as aggregation_strategy="none".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packed_transformers.inference.precision import device_problem
from packed_transformers.inference.predictions import class_scores
from packed_transformers.inference.runner import Runner, per_sequence, per_sequence_tokens, per_token
from packed_transformers.inference.token_task import TaggedTexts, entities
from packed_transformers.model.families import max_tokens
from packed_transformers.packs.tokenized import pack_examples

PIPELINE_TASKS = {
    "text-classification": "PackedBertForSequenceClassification",
    "question-answering": "PackedBertForQuestionAnswering",
    "token-classification": "PackedBertForTokenClassification",
}


def packed_pipeline(
    task: str,
    model,
    tokenizer=None,
    batch_size: int = 64,
    max_sequences_per_pack: int | None = None,
    algorithm: str = "lpfhp",
    max_length: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    **options,
):
    """A callable for `task` (PIPELINE_TASKS). model: a saved folder or a packed model;
    tokenizer: a transformers fast tokenizer or a folder (default: the model folder).
    batch_size counts examples (packs per batch = batch_size / packing factor).
    Options: top_k (text-classification), ignore_labels (token-classification),
    doc_stride, n_best_size, max_answer_length, version_2_with_negative,
    null_score_diff_threshold (question-answering). dtype: "float32", "bfloat16" (bf16
    autocast; ValueError where the device has no bf16) or "int8" (a CPU with VNNI;
    inference.precision)."""
    if task not in PIPELINE_TASKS:
        raise ValueError(f"task {task!r}: expected one of {', '.join(PIPELINE_TASKS)}")
    problem = device_problem(device, dtype)
    if problem:
        raise ValueError(problem)
    from transformers import AutoTokenizer

    from packed_transformers.door.opener import open_folder

    input_limit = None
    if isinstance(model, str | Path):  # opened as predict and the server open it (LoadedModel)
        loaded = open_folder(Path(model))
        wanted = {"text-classification": "classification", "question-answering": "question_answering",
                  "token-classification": "token_classification"}[task]  # fmt: skip
        if loaded.spec.task != wanted:
            raise ValueError(f"{model}: a {loaded.spec.task} model; task {task!r} needs a {wanted} model")
        model = loaded.model
        tokenizer = tokenizer or loaded.hf_tokenizer()
        input_limit = loaded.max_length  # the door's limit (QA's windows stay max_length or 384)
    if tokenizer is None:
        raise ValueError("tokenizer: give a tokenizer (or a folder) when model is not a folder")
    if isinstance(tokenizer, str | Path):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    runner = _Runner(
        Runner(model, device, dtype),
        tokenizer,
        batch_size,
        max_sequences_per_pack,
        algorithm,
        max_length or input_limit,
        ("start_logits", "end_logits") if task == "question-answering" else ("logits",),
    )
    if task == "text-classification":
        default_top_k = options.get("top_k", 1)
        return lambda inputs, top_k=default_top_k: runner.classify(inputs, top_k)
    if task == "token-classification":
        ignore = options.get("ignore_labels", ["O"])
        return lambda inputs: runner.tag(inputs, ignore)
    # QA windows: max_length tokens (384 unless given, the reference's), doc_stride overlap.
    return lambda inputs: runner.answer(inputs, {**options, "max_length": max_length or 384})


def _check_texts(texts: list, what: str, allow_none: bool = False, allow_empty: bool = True) -> None:
    """ValueError naming the input unless each text passes data.text_rule (a string of valid
    Unicode, what the tokenizer can encode); `allow_none`: a missing text pair is fine;
    `allow_empty`: a blank text is (a classification of "" is asked for; a blank QA context
    has no answer to find)."""
    from packed_transformers.data.text_rule import check_text  # its ExampleError is a ValueError

    for i, text in enumerate(texts):
        check_text(text, f"input {i}: {what}", empty_ok=allow_empty, none_ok=allow_none)


class _Runner:
    """The three tasks' tokenization and answers around one inference.runner.Runner."""

    def __init__(self, runner: Runner, tokenizer, batch_size, max_per_pack, algorithm, max_length, outputs):
        self.runner, self.model, self.tokenizer, self.outputs = runner, runner.model, tokenizer, outputs
        self.batch_size, self.max_per_pack, self.algorithm = batch_size, max_per_pack, algorithm
        # a model object handed in (no folder, so no door): the limit of its position table
        self.max_length = max_length or max_tokens(self.model.config)

    def run(self, token_ids: list, segment_ids: list) -> list:
        """Pack the examples, run every batch of packs -> [inference.runner.RunBatch]."""
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        width = int(lengths.max())
        table = pack_examples(lengths, width, self.max_per_pack, self.algorithm, seed=0)
        packs_per_batch = max(1, round(self.batch_size * len(table) / len(lengths)))
        tables = [table[first : first + packs_per_batch] for first in range(0, len(table), packs_per_batch)]
        token_ids = [np.asarray(t, dtype=np.int64) for t in token_ids]
        segment_ids = None if segment_ids is None else [np.asarray(s, dtype=np.int64) for s in segment_ids]
        return list(self.runner.run(token_ids, tables, lambda _: width, segment_ids, self.outputs))

    def encode(self, first, second=None, **options):
        return self.tokenizer(first, second, truncation=True, max_length=self.max_length, **options)

    # ----- the three tasks ---------------------------------------------------------------
    def classify(self, inputs, top_k):
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        firsts = [
            t[0] if isinstance(t, tuple | list) else t.get("text") if isinstance(t, dict) else t
            for t in texts
        ]
        seconds = [
            t[1] if isinstance(t, tuple | list) else t.get("text_pair") if isinstance(t, dict) else None
            for t in texts
        ]
        _check_texts(firsts, "the text")
        _check_texts(seconds, "the text pair", allow_none=True)
        if not texts:
            return []
        if all(s is None for s in seconds):
            encoded = self.encode(firsts)
        else:
            encoded = self.encode(firsts, [s or "" for s in seconds])
        batches = self.run(encoded["input_ids"], encoded.get("token_type_ids"))
        config = self.model.config
        logits = per_sequence(batches, "logits", len(texts))
        scores = class_scores(logits, config.problem_type == "multi_label_classification")
        names = [config.id2label.get(i, f"LABEL_{i}") for i in range(scores.shape[1])]
        out = []
        for row in scores:
            ranked = [{"label": names[c], "score": float(row[c])} for c in np.argsort(-row, kind="stable")]
            out.append(ranked[:top_k] if top_k is not None else ranked)
        if top_k == 1:
            out = [r[0] for r in out]
        return out[0] if isinstance(inputs, str) else out

    def answer(self, inputs, options):
        from packed_transformers.data.qa_data import QaExamples
        from packed_transformers.data.qa_windows import make_windows
        from packed_transformers.inference.qa_answers import AnswerSettings, best_answers
        from packed_transformers.inference.question_answering import offsets_table

        items = [inputs] if isinstance(inputs, dict) else list(inputs)
        if not items:
            return []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not {"question", "context"} <= set(item):
                raise ValueError(f'input {i}: expected {{"question": ..., "context": ...}}')
        for name in ("question", "context"):
            _check_texts([item[name] for item in items], f"the {name}", allow_empty=False)
        examples = QaExamples(
            [str(i) for i in range(len(items))],
            [item["question"] for item in items],
            [item["context"] for item in items],
            [None] * len(items),
            [f"input {i}" for i in range(len(items))],
        )
        windows = make_windows(
            examples, self.tokenizer, options.get("max_length", 384), options.get("doc_stride", 128)
        )
        batches = self.run(windows.token_ids, windows.segment_ids)
        start, end = (per_token(batches, name, windows.lengths) for name in ("start_logits", "end_logits"))
        settings = AnswerSettings(
            options.get("n_best_size", 20),
            options.get("max_answer_length", 30),
            options.get("version_2_with_negative", False),
            options.get("null_score_diff_threshold", 0.0),
        )
        answers = best_answers(
            start, end, offsets_table(windows, start.shape[1]), windows.example_of_window,
            examples.contexts, settings,
        )  # fmt: skip
        out = [
            {"score": float(p), "start": int(s), "end": int(e), "answer": text}
            for text, (s, e), p in zip(answers.text, answers.spans, answers.probability)
        ]
        return out[0] if isinstance(inputs, dict) else out

    def tag(self, inputs, ignore_labels):
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        _check_texts(texts, "the text")
        if not texts:
            return []
        encoded = self.encode(texts, return_offsets_mapping=True, return_special_tokens_mask=True)
        ids = encoded["input_ids"]
        batches = self.run(ids, encoded.get("token_type_ids"))
        logits = per_sequence_tokens(batches, "logits", [len(t) for t in ids])
        tagged = TaggedTexts(
            ids, encoded.get("token_type_ids"), [np.asarray(o).reshape(-1, 2) for o in encoded["offset_mapping"]],
            [np.asarray(m, dtype=bool) for m in encoded["special_tokens_mask"]],
            [self.tokenizer.convert_ids_to_tokens(t) for t in ids], 0,
        )  # fmt: skip
        names = self.model.config.id2label
        labels = [names.get(c, str(c)) for c in range(logits[0].shape[-1])]
        out = [entities(logits[i], tagged, i, labels, ignore_labels) for i in range(len(texts))]
        return out[0] if isinstance(inputs, str) else out
