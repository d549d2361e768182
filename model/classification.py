"""Packed sequence classification: one [CLS]-pooled prediction per example of a pack.

from model.classification import PackedBertForSequenceClassification
m = PackedBertForSequenceClassification.from_pretrained(folder, num_labels=5)
out = m(**rows)            # inference.rows.pack_rows fields, as tensors, + labels
out["logits"]              # [B, K, C]; slots with example_index < 0 are absent
out["loss_sum"], out["count"], out["correct"], out["correct_count"]

Parameter names are Hugging Face's BertForSequenceClassification (`bert.*`,
`classifier.*`): checkpoints move both ways by name. Unpacked batches are the K = 1 case
(one example per row, sequence_ids 1 on its tokens), so every batching mode runs this
same module.
"""

from __future__ import annotations

from transformers import BertConfig

from model.classifier_head import (  # noqa: F401 - re-exported
    PROBLEM_TYPES,
    SequenceClassifierHead,
    classification_metrics,
    classification_outputs,
)
from model.packed_head import TRAINER_IGNORED_OUTPUTS, PackedHead

__all__ = [
    "PROBLEM_TYPES",
    "TRAINER_IGNORED_OUTPUTS",
    "PackedBertForSequenceClassification",
    "classification_metrics",
    "classification_outputs",
]


class PackedBertForSequenceClassification(SequenceClassifierHead, PackedHead):
    """[CLS] -> pooler -> dropout -> classifier, per sequence of a pack (model.packed_head;
    the head's layers and read-out: model.classifier_head)."""

    reference_class = "BertForSequenceClassification"
    add_pooling_layer = True
    reference_options = {"ignore_mismatched_sizes": False}

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.add_head(config)
