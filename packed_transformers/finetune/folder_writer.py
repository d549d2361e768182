"""finetune.train's model folder, written: the weights as transformers saves them, the
tokenizer the model was trained with, and finetune.json (what door.folder_spec reads back).

FOLDER/
    config.json, model.safetensors   Hugging Face BertForSequenceClassification, or
                                     BertForQuestionAnswering (task question_answering), or
                                     the family's own task model
    vocab.txt                        the vocabulary the model was trained with
    tokenizer.json, tokenizer_config.json   the checkpoint's own tokenizer files where it had
                                     them; QA: the fast tokenizer, so that AutoTokenizer loads it
    finetune.json                    task; classification: labels, multi_label,
                                     max_sequence_length, pack_length, too_long, input field
                                     names; QA: max_sequence_length, pack_length and the qa
                                     settings; the whole run config
"""

from __future__ import annotations

import shutil
from pathlib import Path

from packed_transformers.common.files import write_json_atomic
from packed_transformers.door.folder_spec import FINETUNE_INFO

# A tokenizer's files as transformers saves them (copied with a model trained on its tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def save_finetuned(
    model,
    config: dict,
    label_names: list[str] | None,
    vocab_file: Path | None,
    folder: Path,
    tokenizer=None,
    tokenizer_source: Path | None = None,
) -> None:
    """HF weights, then the tokenizer (vocab.txt, or, when `vocab_file` is None, the tokenizer
    files of `tokenizer_source`, the checkpoint) and what predict needs to read new text the
    same way."""
    model.save_pretrained(folder)
    data = config["data"]
    own_tokenizer = vocab_file is None
    if own_tokenizer:  # the checkpoint's tokenizer files (tokenizer_source), as they are
        for name in TOKENIZER_FILES:
            if (tokenizer_source / name).is_file():
                shutil.copyfile(tokenizer_source / name, folder / name)
    else:
        shutil.copyfile(vocab_file, folder / "vocab.txt")
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
            "tokenizer": "tokenizer.json" if own_tokenizer else "vocab.txt",
            "config": config,
        },
    )
