"""The token classifier's head, whatever the model's base: every token -> dropout ->
classifier, and the outputs every packed token classifier returns. Mixed into the trainable
PackedBertForTokenClassification (model/token_classification.py) and the inference-only
model.inference_head.TokenClassifierForInference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.dropout import Dropout
from model.outputs import PackedOutput
from model.packed_rows import SlotRows


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
