"""The extractive QA head, whatever the model's base: every token -> qa_outputs (start, end),
each window's answer distribution over its own tokens, and the outputs every packed QA head
returns. Mixed into the trainable PackedBertForQuestionAnswering (model/question_answering.py)
and the inference-only model.inference_head.QuestionAnsweringForInference.
"""

from __future__ import annotations

import torch
from torch import nn

from model.encoder import slot_masks
from model.outputs import PackedOutput
from model.packed_rows import SlotRows, examples_in, present_slot_metrics


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
