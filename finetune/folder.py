"""The fine-tuned model folder: what `finetune.train` writes and `finetune.predict` reads.

FOLDER/
    config.json, model.safetensors   Hugging Face BertForSequenceClassification
    vocab.txt                        the vocabulary the model was trained with
    finetune.json                    labels, multi_label, max_sequence_length, pack_length,
                                     too_long, input field names, the whole run config
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.files import write_json_atomic
from data.classification_data import ExampleError
from data.tokenizer import load_tokenizer
from model.classification import PackedBertForSequenceClassification

FINETUNE_INFO = "finetune.json"


def save_finetuned(model, config: dict, label_names: list[str], vocab_file: Path, folder: Path) -> None:
    """HF weights, then the vocabulary and what predict needs to read new text the same way."""
    model.save_pretrained(folder)
    shutil.copyfile(vocab_file, folder / "vocab.txt")
    data = config["data"]
    write_json_atomic(
        folder / FINETUNE_INFO,
        {
            "labels": label_names,
            "multi_label": data["multi_label"],
            "max_sequence_length": data["max_sequence_length"],
            "pack_length": config["batching"]["pack_length"],
            "too_long": data["too_long"],
            "fields": {"text": data["text_field"], "pair": data["pair_field"], "label": data["label_field"]},
            "config": config,
        },
    )


def load_finetuned(folder: Path):
    """(model, info, tokenizer, vocab) from a `finetune.train` output model folder."""
    info_path = folder / FINETUNE_INFO
    if not info_path.is_file():
        raise ExampleError(f"{folder}: no {FINETUNE_INFO}; expected a folder written by finetune.train")
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        missing = [
            key for key in ("labels", "multi_label", "max_sequence_length", "fields") if key not in info
        ]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
        raise ExampleError(f"{info_path}: not a {FINETUNE_INFO} written by finetune.train ({err})") from None
    if missing:
        raise ExampleError(f"{info_path}: fields {missing} are missing")
    tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
    try:
        model = PackedBertForSequenceClassification.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExampleError(f"{folder}: the model cannot be loaded ({first[:200]})") from None
    return model, info, tokenizer, vocab
