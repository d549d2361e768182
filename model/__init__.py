"""Packed BERT (PyTorch). Never imports poptorch; reads no files but checkpoints."""

from model.config import ATTENTION_BACKENDS, PRESETS, bert_config
from model.pretraining import PackedBertForPreTraining
from model.stages import stage_layer_ranges

__all__ = [
    "ATTENTION_BACKENDS",
    "PRESETS",
    "PackedBertForPreTraining",
    "bert_config",
    "stage_layer_ranges",
]
