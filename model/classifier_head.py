"""The sequence classifier's head, whatever the model's base: [CLS] -> pooler -> dropout ->
classifier, per sequence of a pack, and the outputs every packed classifier returns.

`SequenceClassifierHead` is mixed into the trainable PackedBertForSequenceClassification
(a transformers PreTrainedModel, model/classification.py) and into the inference-only
model.inference_head.SequenceClassifierForInference (a plain torch module, which a command
that only predicts loads without importing transformers' modeling code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.dropout import Dropout
from model.outputs import PackedOutput
from model.packed_rows import SlotRows, examples_in, present_slot_metrics

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification")


class SequenceClassifierHead:
    """The head's layers and read-out over `self.bert`'s pooler (see module docstring)."""

    reads_cls_only = True

    def add_head(self, config) -> None:
        """dropout and classifier [hidden -> num_labels], as BertForSequenceClassification."""
        if config.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type must be one of {PROBLEM_TYPES}, got {config.problem_type!r}")
        dropout = config.classifier_dropout
        self.dropout = Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @property
    def multi_label(self) -> bool:
        return self.config.problem_type == "multi_label_classification"

    def read_out(self, hidden, rows: SlotRows, labels, num_items_in_batch) -> dict:
        """[CLS] hidden [B, K, H] -> logits [B, K, C] (+ loss and metric sums with labels).
        labels: int [B, K] class ids (single-label) or {0, 1} [B, K, C] (multi-label); any
        value in absent slots (example_index < 0) is ignored (hf_integration.trainer writes -100).
        Outputs also `example_index` and, with labels, `example_loss` [B, K] (0 where
        absent): per-example values that transformers' Trainer gathers for evaluation."""
        pooled = self.bert.pooler.pool(hidden)  # [B, K, H]
        logits = self.classifier(self.dropout(pooled))
        return classification_outputs(logits, rows, labels, num_items_in_batch, self.multi_label)

    @classmethod
    def configure_options(cls) -> tuple[str, ...]:
        return ("problem_type",)

    @classmethod
    def configure(cls, config, num_labels, overrides, problem_type: str | None = None) -> None:
        """num_labels must match a fine-tuned checkpoint's head; problem_type defaults to the
        folder's, else single-label."""
        super().configure(config, num_labels, overrides)
        config.problem_type = problem_type or config.problem_type or PROBLEM_TYPES[0]


def classification_outputs(logits, rows: SlotRows, labels, num_items_in_batch, multi_label: bool) -> dict:
    """Every packed classifier's outputs, in the order transformers' Trainer gathers them
    (logits, example_loss, example_index once keys_to_ignore_at_inference are dropped).

    logits [B, K, C]; labels as read_out's, or None. With Trainer's num_items_in_batch
    (the step's label items over all micro-batches) the loss is the loss sum over that
    many examples, so gradient accumulation weighs examples, not micro-batches."""
    out = PackedOutput(logits=logits, present=rows.present)
    if labels is not None:
        out.update(classification_metrics(logits, labels, out["present"], multi_label))
        examples = examples_in(num_items_in_batch, logits.shape[-1] if multi_label else 1)
        if examples is not None:
            out["loss"] = out["loss"] * out["count"] / examples  # = the loss sum / examples
    out["example_index"] = rows.example_index
    return out


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
    return present_slot_metrics(per_example, present, torch.where(present, hits, 0).sum(), correct_count)
