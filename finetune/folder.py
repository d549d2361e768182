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
    info = json.loads(info_path.read_text())
    tokenizer, vocab = load_tokenizer(folder / "vocab.txt")
    model = PackedBertForSequenceClassification.from_pretrained(folder)
    return model, info, tokenizer, vocab
