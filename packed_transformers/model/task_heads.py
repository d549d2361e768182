"""The task heads every packed model reads its sequences with, whatever its stack (this
project's BERT, the other families on transformers' modules), and the outputs each returns:

    classification   [CLS] (or the family's pooled read) -> classifier, per sequence of a pack
    span             start/end logits per token; a window's answer over its own tokens only
    token            a label per token of every sequence
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from packed_transformers.model.encoder import slot_masks
from packed_transformers.model.layers import Dropout
from packed_transformers.model.outputs import PackedOutput
from packed_transformers.model.packed_rows import SlotRows, examples_in, present_slot_metrics

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


class SpanHead:
    """The head's layer and read-out (see module docstring)."""

    def add_head(self, config) -> None:
        """qa_outputs [hidden -> 2], as BertForQuestionAnswering."""
        config.num_labels = 2
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    def read_out(self, hidden, rows: SlotRows, labels, num_items_in_batch) -> dict:
        """hidden [B, S, H] -> start_logits, end_logits [B, S] (fp32), and with labels int
        [B, K, 2] (start, end inside each window; anything in absent slots) the loss, metric
        sums and `example_loss` [B, K]. Also `example_index` and `sequence_ids`: what maps a
        row's logits to its windows, for transformers' Trainer."""
        start_logits, end_logits = self.qa_outputs(hidden).float().unbind(-1)
        return span_outputs(start_logits, end_logits, rows, labels, num_items_in_batch)

    @classmethod
    def configure(cls, config, num_labels, overrides) -> None:
        """Two outputs (start, end) whatever is asked; a pooler in the checkpoint is not used."""
        super().configure(config, 2, overrides)


def span_outputs(start_logits, end_logits, rows: SlotRows, labels, num_items_in_batch) -> dict:
    """Every packed QA head's outputs, in the order transformers' Trainer gathers them
    (start, end, example_loss, example_index, sequence_ids). start/end [B, S] fp32;
    labels int [B, K, 2] or None; num_items_in_batch counts 2 label items per window."""
    out = PackedOutput(start_logits=start_logits, end_logits=end_logits, present=rows.present)
    if labels is not None:
        out.update(
            span_metrics(
                start_logits, end_logits, rows.sequence_ids, rows.cls_positions, labels, rows.present
            )
        )
        examples = examples_in(num_items_in_batch, 2)
        if examples is not None:
            out["loss"] = out["loss"] * out["count"] / examples  # = the loss sum / windows
    out["example_index"] = rows.example_index
    out["sequence_ids"] = rows.sequence_ids
    return out


def window_log_probs(logits, sequence_ids, slots: int):
    """Row logits [B, S] -> log-softmax of each slot's window over its own tokens, [B, K, S].

    Tokens of other windows and padding get the most negative finite float, not -inf: an
    absent slot (no tokens) then gives a finite uniform row instead of NaN, and for a
    present window exp(min - max) is exactly 0, so its distribution is the one computed
    on the window alone."""
    own = slot_masks(sequence_ids, slots)
    floor = torch.finfo(logits.dtype).min
    return torch.where(own, logits[:, None, :], floor).log_softmax(-1)


def span_metrics(start_logits, end_logits, sequence_ids, cls_positions, labels, present) -> dict:
    """Loss = mean over present windows of (CE(start) + CE(end)) / 2, each CE over the
    window's own tokens: what BertForQuestionAnswering computes on each window alone.
    correct counts windows whose arg-max start and end both hit their labels.

    start_logits, end_logits [B, S] fp32; cls_positions [B, K]; labels int [B, K, 2]
    (positions inside the window; anything in absent slots); present bool [B, K]."""
    slots = cls_positions.shape[1]
    targets = torch.where(present[..., None], labels.long() + cls_positions[..., None].long(), 0)
    per_window, hits = [], []
    for column, logits in enumerate((start_logits, end_logits)):
        log_probs = window_log_probs(logits, sequence_ids, slots)  # [B, K, S]
        target = targets[..., column]
        per_window.append(-log_probs.gather(-1, target[..., None]).squeeze(-1))
        hits.append(log_probs.argmax(-1) == target)
    loss = (per_window[0] + per_window[1]) / 2
    return present_slot_metrics(loss, present, (present & hits[0] & hits[1]).sum(), present.sum())


class TokenClassifierHead:
    """The head's layers and read-out (see module docstring)."""

    def add_head(self, config) -> None:
        """dropout and classifier [hidden -> num_labels], as BertForTokenClassification."""
        dropout = config.classifier_dropout
        self.dropout = Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def read_out(self, hidden, rows: SlotRows, labels, num_items_in_batch) -> dict:
        """hidden [B, S, H] -> logits [B, S, C]; with labels int [B, S] (-100: padding,
        special and continuation tokens) the mean cross-entropy over labelled tokens, as
        BertForTokenClassification's, and `token_loss` [B, S] (0 where unlabelled)."""
        logits = self.classifier(self.dropout(hidden))
        return token_outputs(logits, rows, labels, num_items_in_batch)


def token_outputs(logits, rows: SlotRows, labels, num_items_in_batch) -> dict:
    """Every packed token classifier's outputs, in the order transformers' Trainer gathers
    them (logits, example_index, sequence_ids, token_loss). logits [B, S, C]; labels int
    [B, S] (-100: no label) or None; the loss is over the step's labelled tokens
    (Trainer's num_items_in_batch) where given, else over this batch's."""
    out = PackedOutput(logits=logits, example_index=rows.example_index, sequence_ids=rows.sequence_ids)
    if labels is not None:
        labelled = labels != -100
        per_token = F.cross_entropy(
            logits.float().flatten(0, 1), torch.where(labelled, labels, 0).flatten(), reduction="none"
        ).view_as(labels)
        token_loss = torch.where(labelled, per_token, torch.zeros((), device=per_token.device))
        count = labelled.sum()
        denominator = count.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        out.update(
            loss=token_loss.sum() / denominator,
            token_loss=token_loss.detach(),
            loss_sum=token_loss.sum().detach(),
            count=count,
            correct=((logits.argmax(-1) == labels) & labelled).sum(),
            correct_count=count,
        )
    return out
