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

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertPreTrainedModel

from model.classification import TRAINER_IGNORED_OUTPUTS
from model.config import check_packing_options
from model.dropout import Dropout
from model.encoder import PackedBertModel
from model.hf_checkpoint import adopt_weights, load_reference, read_config, save_as_reference


class PackedBertForTokenClassification(BertPreTrainedModel):
    """A transformers PreTrainedModel (Trainer saves, checkpoints and resumes it; it
    accepts Trainer's num_items_in_batch, the labelled tokens of the whole step)."""

    accepts_loss_kwargs = True

    def __init__(self, config: BertConfig):
        super().__init__(config)
        config.keys_to_ignore_at_inference = TRAINER_IGNORED_OUTPUTS
        config.attention_backend = getattr(config, "attention_backend", "dense")
        config.recompute_layers = getattr(config, "recompute_layers", False)
        check_packing_options(config)
        self.config = config
        self.bert = PackedBertModel(config, add_pooling_layer=False)
        dropout = config.classifier_dropout
        self.dropout = Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.loading_report: dict = {}

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
        """Rows [B, S] -> logits [B, S, C]; with labels int [B, S] (-100: padding, special
        and continuation tokens) the mean cross-entropy over labelled tokens, as
        BertForTokenClassification's, and `token_loss` [B, S] (0 where unlabelled)."""
        slots = cls_positions.shape[1]
        hidden = self.bert(input_ids, position_ids, segment_ids, sequence_ids, slots)
        logits = self.classifier(self.dropout(hidden))
        out = {"logits": logits, "example_index": example_index, "sequence_ids": sequence_ids}
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

    @classmethod
    def from_pretrained(
        cls, folder, num_labels: int | None = None, **overrides
    ) -> PackedBertForTokenClassification:
        """Read an HF BERT folder: a fine-tuned BertForTokenClassification, or any BERT
        encoder whose classifier is then initialised (named in `loading_report`)."""
        folder = Path(folder)
        config = read_config(folder, overrides)
        if num_labels is not None:
            config.num_labels = num_labels
        for key in ("id2label", "label2id"):
            if key in overrides:
                setattr(config, key, overrides[key])
        reference, info = load_reference("BertForTokenClassification", folder, config=config)
        model = cls(config)
        adopt_weights(model, reference.state_dict(), info, folder, level=logging.INFO)
        return model

    def save_pretrained(self, folder, **trainer_options) -> None:
        """A folder transformers.BertForTokenClassification loads as is. Trainer's options
        are accepted; the model's own weights are saved."""
        save_as_reference(self, "BertForTokenClassification", folder)
