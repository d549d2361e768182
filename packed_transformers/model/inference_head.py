"""BERT heads for inference only: plain torch modules, not transformers PreTrainedModels.

The trainable heads (model/packed_head.py) subclass transformers' BertPreTrainedModel so
that `Trainer` saves, checkpoints and resumes them; importing that base costs seconds
(transformers' modeling_utils brings torch._dynamo, torch.distributed.tensor, sympy and
scipy), which a command that only predicts or embeds pays for nothing. These models have
the same layers, the same names and the same forward (model.packed_rows.PackedRows plus the
head's mixin), and read a folder's model.safetensors directly (model.hf_checkpoint.
load_weights: the same strict checks as loading through transformers). model.opening
builds them where a folder is opened for inference (no new head); they are never saved.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import BertConfig

from packed_transformers.model.hf_checkpoint import load_weights
from packed_transformers.model.packed_rows import PackedRows
from packed_transformers.model.task_heads import SequenceClassifierHead, SpanHead, TokenClassifierHead


class InferenceHead(PackedRows, nn.Module):
    """The base: `self.bert` (with a pooler where `add_pooling_layer`) and the loading; the
    `configure` / `configure_options` / `build` contract comes with PackedRows, so that a
    head's mixin configures both bases alike. Subclasses set `reference_class` (the transformers
    class whose names they keep), `reference_options`, `base_model_only`."""

    reference_class: str = "BertModel"
    reference_options: dict = {}
    base_model_only = False

    def __init__(self, config: BertConfig):
        super().__init__()
        self.add_encoder(config)

    @classmethod
    def from_pretrained(
        cls, folder, num_labels: int | None = None, new_head: bool = False, config_dict=None, **overrides
    ):
        """As PackedHead.from_pretrained, for inference: the folder's config.json with the
        overrides, every weight of the model from the file (load_weights)."""
        folder = Path(folder)
        config = cls.configured(folder, num_labels, config_dict, overrides)
        model = cls.build(config)
        load_weights(
            model, folder, config, new_head, cls.reference_class, cls.reference_options, cls.base_model_only
        )
        return model


class SequenceClassifierForInference(SequenceClassifierHead, InferenceHead):
    """PackedBertForSequenceClassification's layers and outputs, for inference only."""

    reference_class = "BertForSequenceClassification"
    reference_options = {"ignore_mismatched_sizes": False}
    add_pooling_layer = True

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.add_head(config)


class TokenClassifierForInference(TokenClassifierHead, InferenceHead):
    """PackedBertForTokenClassification's layers and outputs, for inference only."""

    reference_class = "BertForTokenClassification"

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.add_head(config)


class QuestionAnsweringForInference(SpanHead, InferenceHead):
    """PackedBertForQuestionAnswering's layer and outputs, for inference only."""

    reference_class = "BertForQuestionAnswering"

    def __init__(self, config: BertConfig):
        config.num_labels = 2
        super().__init__(config)
        self.add_head(config)
