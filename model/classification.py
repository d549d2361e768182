"""Packed sequence classification: one [CLS]-pooled prediction per example of a pack.

from model.classification import PackedBertForSequenceClassification
m = PackedBertForSequenceClassification.from_pretrained(folder, num_labels=5)
out = m(**rows)            # finetune.rows.pack_rows fields, as tensors, + labels
out["logits"]              # [B, K, C]; slots with example_index < 0 are absent
out["loss_sum"], out["count"], out["correct"], out["correct_count"]

Parameter names are Hugging Face's BertForSequenceClassification (`bert.*`,
`classifier.*`): checkpoints move both ways by name. Unpacked batches are the K = 1 case
(one example per row, sequence_ids 1 on its tokens), so every batching mode runs this
same module.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertPreTrainedModel

from model.config import check_packing_options
from model.dropout import Dropout
from model.encoder import PackedBertModel
from model.hf_checkpoint import adopt_weights, load_reference, read_config, save_as_reference

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification")
# Outputs transformers' Trainer must not gather as predictions (metric sums, masks).
TRAINER_IGNORED_OUTPUTS = ["present", "loss_sum", "count", "correct", "correct_count"]


def examples_in(num_items_in_batch, items_per_example: int):
    """transformers' Trainer counts a step's items as `labels != -100` over its micro-batches
    (its num_items_in_batch): examples x items_per_example. -> examples, or None."""
    if num_items_in_batch is None:
        return None
    return num_items_in_batch / items_per_example


class PackedBertForSequenceClassification(BertPreTrainedModel):
    """A transformers PreTrainedModel, so that `Trainer` saves it as a folder and
    checkpoints and resumes it; it accepts Trainer's `num_items_in_batch` (gradient
    accumulation normalises by the examples of the whole step)."""

    accepts_loss_kwargs = True

    def __init__(self, config: BertConfig):
        super().__init__(config)
        config.keys_to_ignore_at_inference = TRAINER_IGNORED_OUTPUTS
        config.attention_backend = getattr(config, "attention_backend", "dense")
        config.recompute_layers = getattr(config, "recompute_layers", False)
        if config.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type must be one of {PROBLEM_TYPES}, got {config.problem_type!r}")
        check_packing_options(config)
        self.config = config
        self.bert = PackedBertModel(config)
        dropout = config.classifier_dropout
        self.dropout = Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.loading_report: dict = {}

    @property
    def multi_label(self) -> bool:
        return self.config.problem_type == "multi_label_classification"

    def forward(
        self,
        input_ids,
        segment_ids,
        position_ids,
        sequence_ids,
        cls_positions,
        example_index,
        labels=None,
        num_items_in_batch=None,
        **unused,
    ) -> dict:
        """Rows [B, S] and slots [B, K] -> logits [B, K, C] (+ loss and metric sums with labels).

        labels: int [B, K] class ids (single-label) or {0, 1} [B, K, C] (multi-label); any
        value in absent slots (example_index < 0) is ignored (finetune.hf writes -100).
        Outputs also `example_index` and, with labels, `example_loss` [B, K] (0 where
        absent): per-example values that transformers' Trainer gathers for evaluation."""
        slots = cls_positions.shape[1]
        # Only the [CLS] rows are read: the last layer computes those alone (its queries,
        # attention output and feed-forward block; keys and values from every token), about
        # 5/6 of a layer's work saved, with the same logits and gradients.
        cls_hidden = self.bert(
            input_ids, position_ids, segment_ids, sequence_ids, slots, read_positions=cls_positions
        )
        pooled = self.bert.pooler.pool(cls_hidden)  # [B, K, H]
        logits = self.classifier(self.dropout(pooled))
        out = {"logits": logits, "present": example_index >= 0}
        if labels is not None:
            out.update(classification_metrics(logits, labels, out["present"], self.multi_label))
            examples = examples_in(num_items_in_batch, logits.shape[-1] if self.multi_label else 1)
            if examples is not None:
                out["loss"] = out["loss"] * out["count"] / examples  # = the loss sum / examples
        out["example_index"] = example_index
        return out

    # ----- Hugging Face checkpoints -----------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, folder, num_labels: int | None = None, problem_type: str | None = None, **overrides
    ) -> PackedBertForSequenceClassification:
        """Read an HF BERT folder: a fine-tuned BertForSequenceClassification, or any
        BERT encoder (bare BertModel, BertForPreTraining) whose classifier is then
        initialised and named in `loading_report` and the log. num_labels must match a
        fine-tuned checkpoint's head; overrides set non-shape options (dropout, ...)."""
        folder = Path(folder)
        config = read_config(folder, overrides)
        if num_labels is not None:
            config.num_labels = num_labels
        config.problem_type = problem_type or config.problem_type or PROBLEM_TYPES[0]
        for key in ("id2label", "label2id"):  # num_labels just reset them; overrides win
            if key in overrides:
                setattr(config, key, overrides[key])
        reference, info = load_reference(
            "BertForSequenceClassification", folder, config=config, ignore_mismatched_sizes=False
        )
        model = cls(config)
        # A new task's classifier is always initialised: that is news, not a warning.
        adopt_weights(model, reference.state_dict(), info, folder, level=logging.INFO)
        return model

    def save_pretrained(self, folder, **trainer_options) -> None:
        """A folder transformers.BertForSequenceClassification loads as is (safetensors,
        id2label in config.json). Atomic: temporary folder, then rename. Trainer's options
        (state_dict, safe_serialization) are accepted; the weights saved are the model's."""
        save_as_reference(self, "BertForSequenceClassification", folder)


def classification_metrics(logits, labels, present, multi_label: bool) -> dict:
    """Per-example losses over present slots only; sums and counts, never means of means.

    logits [B, K, C]; present bool [B, K]. Single-label: cross-entropy, labels int [B, K].
    Multi-label: BCE-with-logits averaged over the C labels of an example (HF's mean over
    examples x labels, per example), labels {0, 1} [B, K, C]; correct counts labels whose
    sign(logit) matches, so correct_count = examples x C. ignore_index does not exist for
    BCE: absent slots are removed with torch.where, so even a non-finite loss there
    cannot leak into the sum.
    """
    logits = logits.float()
    count = present.sum()
    if multi_label:
        targets = labels.float()
        per_example = F.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(-1)
        hits = ((logits > 0) == (targets > 0.5)).sum(-1)
        correct_count = count * logits.shape[-1]
    else:
        target = torch.where(present, labels.long(), 0)
        per_example = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
        per_example = per_example.view_as(target)
        hits = logits.argmax(-1) == target
        correct_count = count
    zero = torch.zeros((), dtype=per_example.dtype, device=per_example.device)
    example_loss = torch.where(present, per_example, zero)
    loss_sum = example_loss.sum()
    return {
        "example_loss": example_loss.detach(),
        "loss": loss_sum / count.clamp(min=1),
        "loss_sum": loss_sum.detach(),
        "count": count,
        "correct": torch.where(present, hits, 0).sum(),
        "correct_count": correct_count,
    }
