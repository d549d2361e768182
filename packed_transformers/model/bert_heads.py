"""This project's trainable packed BERT task models (transformers PreTrainedModels, for Trainer
and fine-tuning), each a head of model.task_heads over model.packed_head's base:

    m = PackedBertForSequenceClassification.from_pretrained(folder, num_labels=5)
    m = PackedBertForQuestionAnswering.from_pretrained(folder)
    m = PackedBertForTokenClassification.from_pretrained(folder, num_labels=9)
    out = m(**rows)     # packs.rows.pack_rows fields, as tensors, + labels

Parameter names are Hugging Face's BertFor... classes' (`bert.*`, `classifier.*`, `qa_outputs.*`):
checkpoints move both ways by name. Unpacked batches are the K = 1 case, so every batching
mode runs the same modules.
"""

from __future__ import annotations

from transformers import BertConfig

from packed_transformers.model.packed_head import TRAINER_IGNORED_OUTPUTS, PackedHead
from packed_transformers.model.task_heads import (  # noqa: F401 - re-exported
    PROBLEM_TYPES,
    SequenceClassifierHead,
    SpanHead,
    TokenClassifierHead,
    classification_metrics,
    classification_outputs,
    span_metrics,
    span_outputs,
    token_outputs,
    window_log_probs,
)

__all__ = [
    "PROBLEM_TYPES",
    "TRAINER_IGNORED_OUTPUTS",
    "PackedBertForQuestionAnswering",
    "PackedBertForSequenceClassification",
    "PackedBertForTokenClassification",
    "classification_metrics",
    "classification_outputs",
    "span_metrics",
    "span_outputs",
    "token_outputs",
    "window_log_probs",
]


class PackedBertForSequenceClassification(SequenceClassifierHead, PackedHead):
    """[CLS] -> pooler -> dropout -> classifier, per sequence of a pack (model.packed_head;
    the head's layers and read-out: model.task_heads)."""

    reference_class = "BertForSequenceClassification"
    add_pooling_layer = True
    reference_options = {"ignore_mismatched_sizes": False}

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.add_head(config)


class PackedBertForQuestionAnswering(SpanHead, PackedHead):
    """Every token -> qa_outputs (start, end) (model.packed_head; the head: model.task_heads);
    Trainer's num_items_in_batch counts 2 label items per window."""

    reference_class = "BertForQuestionAnswering"

    def __init__(self, config: BertConfig):
        config.num_labels = 2
        super().__init__(config)
        self.add_head(config)


class PackedBertForTokenClassification(TokenClassifierHead, PackedHead):
    """Every token -> dropout -> classifier (model.packed_head; the head: model.task_heads);
    Trainer's num_items_in_batch is the labelled tokens of the whole step."""

    reference_class = "BertForTokenClassification"

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.add_head(config)
