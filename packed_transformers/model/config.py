"""Model configuration: Hugging Face `BertConfig` fields plus packing options.

Extra attributes (kept by BertConfig, saved in config.json, ignored by transformers):
    attention_backend: "dense" | "sdpa" | "flex" | "varlen"
    mlm_loss_mode:     "per_token" (MLPerf: mean over all masked tokens) |
                       "per_sequence" (the paper's option: mean per sequence, then over sequences)
    recompute_layers:  bool, activation recomputation (checkpointing) of every encoder layer
"""

from __future__ import annotations

from transformers import BertConfig

from packed_transformers.common.choices import ATTENTION_BACKENDS
from packed_transformers.common.constants import BERT_VOCAB_SIZE

MLM_LOSS_MODES = ("per_token", "per_sequence")

PRESETS = {
    "bert-large": dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    ),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128),
    "bert-mini": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
}


def bert_config(preset: str = "bert-large", **overrides) -> BertConfig:
    """A BertConfig for a preset (vocab BERT_VOCAB_SIZE, 512 positions, 2 segment types) + overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {sorted(PRESETS)}")
    fields = dict(
        vocab_size=BERT_VOCAB_SIZE,
        max_position_embeddings=512,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        attention_backend="dense",
        mlm_loss_mode="per_token",
        recompute_layers=False,
    )
    fields.update(PRESETS[preset])
    fields.update(overrides)
    config = BertConfig(**fields)
    check_packing_options(config)
    return config


def check_packing_options(config: BertConfig) -> None:
    backend = getattr(config, "attention_backend", "dense")
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    mode = getattr(config, "mlm_loss_mode", "per_token")
    if mode not in MLM_LOSS_MODES:
        raise ValueError(f"mlm_loss_mode must be one of {MLM_LOSS_MODES}, got {mode!r}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size {config.hidden_size} is not divisible by "
            f"num_attention_heads {config.num_attention_heads}"
        )


# Options of the packed model that a plain BERT config.json does not carry.
PACKING_DEFAULTS = dict(attention_backend="dense", mlm_loss_mode="per_token", recompute_layers=False)


def set_packing_defaults(config: BertConfig) -> BertConfig:
    """Fill the packing options a plain BERT config lacks, then check them all."""
    for key, value in PACKING_DEFAULTS.items():
        if not hasattr(config, key):
            setattr(config, key, value)
    check_packing_options(config)
    return config


# ----- pipeline stages: which encoder layers each stage holds ------------------------------------
def stage_layer_ranges(num_layers: int, layers_per_stage: list[int]) -> list[range]:
    """The encoder-layer indices of each stage; clear errors for invalid splits."""
    if not layers_per_stage:
        raise ValueError("layers_per_stage is empty: give the number of encoder layers per stage")
    if any((not isinstance(n, int)) or isinstance(n, bool) or n < 0 for n in layers_per_stage):
        raise ValueError(f"layers_per_stage must hold integers >= 0, got {layers_per_stage}")
    if sum(layers_per_stage) != num_layers:
        raise ValueError(
            f"layers_per_stage {layers_per_stage} sums to {sum(layers_per_stage)}, "
            f"but the model has {num_layers} encoder layers"
        )
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def nonempty_stage_ranges(num_layers: int, layers_per_stage) -> list[range]:
    """`stage_layer_ranges`, and every stage must hold a layer (an empty stage would idle
    its device and its process). The one check of `execution.layers_per_stage` for the
    torch pipeline and the IPU plan; ValueError with a message the caller prefixes."""
    ranges = stage_layer_ranges(num_layers, list(layers_per_stage))
    if any(len(r) == 0 for r in ranges):
        raise ValueError(f"{list(layers_per_stage)}: a stage without layers; every stage needs one")
    return ranges
