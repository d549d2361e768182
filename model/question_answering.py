"""Packed extractive question answering: start/end logits for every token of a pack, each
window's answer distribution taken over its own tokens only.

from model.question_answering import PackedBertForQuestionAnswering
m = PackedBertForQuestionAnswering.from_pretrained(folder)
out = m(**rows)              # inference.rows.pack_rows fields, as tensors, + labels [B, K, 2]
out["start_logits"], out["end_logits"]    # [B, S], one per token of the row
out["loss_sum"], out["count"], out["correct"], out["correct_count"]

Parameter names are Hugging Face's BertForQuestionAnswering (`bert.*` without a pooler,
`qa_outputs.*`): checkpoints move both ways by name. A window's start/end labels are token
positions inside the window (0 = its [CLS], the reference's "no answer here"); the model
moves them to the window's place in the row through cls_positions.
"""

from __future__ import annotations

from transformers import BertConfig

from model.packed_head import PackedHead
from model.span_head import SpanHead, span_metrics, span_outputs, window_log_probs  # noqa: F401 - re-exported


class PackedBertForQuestionAnswering(SpanHead, PackedHead):
    """Every token -> qa_outputs (start, end) (model.packed_head; the head: model.span_head);
    Trainer's num_items_in_batch counts 2 label items per window."""

    reference_class = "BertForQuestionAnswering"

    def __init__(self, config: BertConfig):
        config.num_labels = 2
        super().__init__(config)
        self.add_head(config)
