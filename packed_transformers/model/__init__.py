"""Packed transformer models (PyTorch): this project's packed BERT on every attention backend,
the other encoder families and the decoders on transformers' own modules with packed
attention, the heads, losses, and the one builder of a packed model from a folder
(model.opening.open_model, which door/ alone calls). Never imports poptorch, packing/,
data/ or any room above it; reads no files but checkpoints.
"""

from packed_transformers.model.config import ATTENTION_BACKENDS, PRESETS, bert_config, stage_layer_ranges
from packed_transformers.model.pretraining import PackedBertForPreTraining

__all__ = [
    "ATTENTION_BACKENDS",
    "PRESETS",
    "PackedBertForPreTraining",
    "bert_config",
    "stage_layer_ranges",
]
