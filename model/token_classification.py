"""Packed token classification (NER, POS): a label per token of every sequence of a pack.

from model.token_classification import PackedBertForTokenClassification
m = PackedBertForTokenClassification.from_pretrained(folder, num_labels=9)
out = m(**rows)          # finetune rows, as tensors, + labels [B, S] (-100 = no label)
out["logits"]            # [B, S, C]

Per-token outputs need no unpacking inside the model: the block-diagonal attention keeps
every token's logits what its own sequence alone gives. Parameter names are Hugging
Face's BertForTokenClassification (`bert.*` without a pooler, `classifier.*`).
"""

from __future__ import annotations

from transformers import BertConfig

from model.packed_head import PackedHead
from model.token_head import TokenClassifierHead, token_outputs  # noqa: F401 - re-exported


class PackedBertForTokenClassification(TokenClassifierHead, PackedHead):
    """Every token -> dropout -> classifier (model.packed_head; the head: model.token_head);
    Trainer's num_items_in_batch is the labelled tokens of the whole step."""

    reference_class = "BertForTokenClassification"

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.add_head(config)
