"""The fine-tuned model folder: what `finetune.train` writes and `finetune.predict` reads.

FOLDER/
    config.json, model.safetensors   Hugging Face BertForSequenceClassification, or
                                     BertForQuestionAnswering (task question_answering)
    vocab.txt                        the vocabulary the model was trained with
    tokenizer.json, tokenizer_config.json   question answering: the fast tokenizer, so that
                                     transformers' AutoTokenizer loads the folder as is
    finetune.json                    task; classification: labels, multi_label,
                                     max_sequence_length, pack_length, too_long, input field
                                     names; QA: max_sequence_length, pack_length and the qa
                                     settings (doc_stride, n_best_size, max_answer_length,
                                     v2.0); the whole run config
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.cli import first_line
from common.files import write_json_atomic
from data.classification_data import ExampleError
from data.tokenizer import load_tokenizer
from model.classification import PackedBertForSequenceClassification
from model.question_answering import PackedBertForQuestionAnswering

FINETUNE_INFO = "finetune.json"
REQUIRED_INFO = {
    "classification": ("labels", "multi_label", "max_sequence_length", "fields"),
    "question_answering": ("max_sequence_length", "qa"),
}


def _info_type_problem(info: dict, task: str) -> str | None:
    """What is of the wrong type in a finetune.json, or None."""

    def text_or_none(value):
        return value is None or isinstance(value, str)

    length = info["max_sequence_length"]
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        return f"'max_sequence_length' must be an integer >= 1, got {length!r}"
    if task == "question_answering":
        return None if isinstance(info["qa"], dict) else f"'qa' must be an object, got {info['qa']!r}"
    labels, fields = info["labels"], info["fields"]
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        return f"'labels' must be a non-empty list of strings, got {labels!r}"
    if not isinstance(info["multi_label"], bool):
        return f"'multi_label' must be true or false, got {info['multi_label']!r}"
    if (
        not isinstance(fields, dict)
        or not isinstance(fields.get("text"), str)
        or not all(text_or_none(fields.get(key)) for key in ("pair", "label"))
    ):
        return f"'fields' must be an object with a string 'text' and string or null 'pair' and 'label', got {fields!r}"
    return None


def save_finetuned(
    model, config: dict, label_names: list[str] | None, vocab_file: Path, folder: Path, tokenizer=None
) -> None:
    """HF weights, then the vocabulary and what predict needs to read new text the same way."""
    model.save_pretrained(folder)
    shutil.copyfile(vocab_file, folder / "vocab.txt")
    data = config["data"]
    if data["task"] == "question_answering":
        tokenizer.save_pretrained(folder)
        write_json_atomic(
            folder / FINETUNE_INFO,
            {
                "task": data["task"],
                "max_sequence_length": data["max_sequence_length"],
                "pack_length": config["batching"]["pack_length"],
                "qa": config["qa"],
                "config": config,
            },
        )
        return
    write_json_atomic(
        folder / FINETUNE_INFO,
        {
            "task": data["task"],
            "labels": label_names,
            "multi_label": data["multi_label"],
            "max_sequence_length": data["max_sequence_length"],
            "pack_length": config["batching"]["pack_length"],
            "too_long": data["too_long"],
            "fields": {"text": data["text_field"], "pair": data["pair_field"], "label": data["label_field"]},
            "config": config,
        },
    )


def load_finetuned(folder: Path, **overrides):
    """(model, info, tokenizer, vocab) from a `finetune.train` output model folder;
    overrides set non-shape model options (attention_backend, ...)."""
    info_path = folder / FINETUNE_INFO
    if not info_path.is_file():
        raise ExampleError(f"{folder}: no {FINETUNE_INFO}; expected a folder written by finetune.train")
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        task = info.get("task", "classification")  # folders from before QA carry no task
        needed = REQUIRED_INFO.get(task)
        if needed is None:
            raise ExampleError(f"{info_path}: task {task!r} is not one of {sorted(REQUIRED_INFO)}")
        missing = [key for key in needed if key not in info]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as err:
        raise ExampleError(f"{info_path}: not a {FINETUNE_INFO} written by finetune.train ({err})") from None
    if missing:
        raise ExampleError(f"{info_path}: fields {missing} are missing")
    problem = _info_type_problem(info, task)
    if problem:
        raise ExampleError(f"{info_path}: {problem} (an edited or foreign {FINETUNE_INFO})")
    info["task"] = task
    tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
    model_class = (
        PackedBertForQuestionAnswering
        if task == "question_answering"
        else PackedBertForSequenceClassification
    )
    try:
        model = model_class.from_pretrained(folder, **overrides)
    except (OSError, ValueError, RuntimeError) as err:
        raise ExampleError(f"{folder}: the model cannot be loaded ({first_line(err)[:200]})") from None
    return model, info, tokenizer, vocab
