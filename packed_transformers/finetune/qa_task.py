"""Extractive question answering as a fine-tuning task: SQuAD questions -> windows ->
batches in any mode -> packed QA model -> per-token logits -> answers -> SQuAD metrics.

    questions (data.qa_data.read_squad)
      -> windows, labels and offsets (data.qa_windows.make_windows)
      -> batch tables of windows (packs.batching.Batcher: padded | dynamic | uniform | packed)
      -> rows (components.batches.collate) -> PackedBertForQuestionAnswering
      -> start/end logits per window (predict_spans) -> answers (inference.qa_answers)
      -> {question id: answer} and EM / F1 (data.squad_metrics)

`finetune.train` runs the loop; this module holds what is particular to QA. A window is
the unit the model sees (what "examples/s" counts in training and inference), a question
the unit that is answered and scored.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from packed_transformers.data.qa_data import QaExamples, read_squad
from packed_transformers.data.qa_windows import fast_tokenizer, make_windows
from packed_transformers.inference.question_answering import QaSplit

log = logging.getLogger("finetune")


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
    from packed_transformers.data.classification_data import ExampleError, split_by_seed

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


def build_qa_model(config: dict, checkpoint: str, checkpoint_config: dict | None = None, tokenizer=None):
    """The trainable QA head, opened through the door (its checks: strict weights, finite
    weights; one line for a folder that cannot be loaded): a LoadedModel carrying `tokenizer`
    (door.folder.FolderTokenizer, the windows' own). checkpoint_config: its config.json as
    read (None: read here)."""
    from packed_transformers.door.opener import ForTraining, open_folder
    from packed_transformers.model.opening import ModelOptions

    model_cfg = config["model"]
    torch.manual_seed(config["training"]["seed"])  # qa_outputs' init
    options = ModelOptions(
        new_head=True,  # fine-tuning: qa_outputs may be new; the encoder must be whole
        attention_backend=model_cfg["attention_backend"],
        dropout={"hidden": model_cfg["hidden_dropout"], "attention": model_cfg["attention_dropout"]},
    )
    return open_folder(
        checkpoint, ForTraining("question_answering", options, checkpoint_config, f"model.init_checkpoint {checkpoint}",
                                tokenizer=tokenizer),
    )  # fmt: skip
