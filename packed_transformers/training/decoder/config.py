"""The schema of decoder-pretraining configs (`run_pretraining.py --config`; a config whose
`model.family` names a decoder family is one of these). Defaults are MLPerf Training 5.1's
llama31_8b rules (mlperf-logging's compliance_checker/training_5.1.0/closed_llama31_8b.yaml):
AdamW (0.9, 0.95, eps 1e-5, weight decay 0.1), gradient clip 1.0, cosine decay with linear
warmup over 1,200,000 samples, 8192-token rows, 1024 evaluation rows, target log perplexity
3.3. The schedule is counted in samples (rows), as the rules count it.
"""

from __future__ import annotations

from packed_transformers.common.config_schema import ConfigError, Key, apply_overrides, resolve
from packed_transformers.common.input_limits import (
    MAX_MODEL_HEADS,
    MAX_MODEL_LAYERS,
    MAX_MODEL_MLP_WIDTH,
    MAX_MODEL_WIDTH,
    MAX_SEQUENCE_LENGTH,
)
from packed_transformers.training.config import SCHEMA as BERT_SCHEMA

DECODER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt2")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "cuda", "ipu", "ipu-model")

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "family": Key(str, "llama", "decoder family (transformers model_type)", DECODER_FAMILIES),
        "init_checkpoint": Key(
            str, None, "causal-LM folder to start from; null = random init", optional=True
        ),
        "hidden_size": Key(int, 4096, "hidden width (random init)", minimum=1, maximum=MAX_MODEL_WIDTH),
        "intermediate_size": Key(
            int, 14336, "MLP width (random init)", minimum=1, maximum=MAX_MODEL_MLP_WIDTH
        ),
        "num_hidden_layers": Key(int, 32, "layers (random init)", minimum=1, maximum=MAX_MODEL_LAYERS),
        "num_attention_heads": Key(int, 32, "query heads (random init)", minimum=1, maximum=MAX_MODEL_HEADS),
        "num_key_value_heads": Key(
            int,
            8,
            "key/value heads (random init; grouped-query attention)",
            minimum=1,
            maximum=MAX_MODEL_HEADS,
        ),
        "rope_theta": Key(
            float, 500000.0, "rotary base (random init; families with rotary positions)", minimum=1
        ),
        "vocab_size": Key(
            int, None, "vocabulary; null = the data's (metadata.json)", optional=True, minimum=1
        ),
        "attention": Key(
            str,
            "auto",
            "packed attention: length buckets (sum of l_i^2), the row's mask, or "
            "auto (buckets for rows over 128 tokens)",
            ("auto", "buckets", "mask"),
        ),  # fmt: skip
    },
    "data": {
        "train_dir": Key(str, None, "training rows (packed pack-documents' <layout>/train)", optional=True),
        "eval_dir": Key(str, None, "evaluation rows (<layout>/eval); null = no evaluation", optional=True),
        "max_sequence_length": Key(
            int,
            8192,
            "expected S of the data (checked against metadata.json)",
            minimum=2,
            maximum=MAX_SEQUENCE_LENGTH,
        ),
        "micro_batch_rows": Key(int, 1, "rows per replica per forward pass", minimum=1),
        "shuffle_seed": Key(int, 12345, "seed of the per-epoch row order", minimum=0),
        "check_sha256": Key(bool, True, "check every shard's sha256 before training"),
    },
    "optim": {
        "lr": Key(float, 1e-3, "peak learning rate", minimum=0),
        "end_lr": Key(float, 1e-4, "learning rate at the end of the cosine", minimum=0),
        "warmup_samples": Key(int, 16384, "linear warmup, in samples (rows)", minimum=0),
        "total_samples": Key(int, 1_200_000, "warmup + cosine decay, in samples (rows)", minimum=1),
        "betas": Key("betas", [0.9, 0.95], "AdamW (beta1, beta2)"),
        "eps": Key(float, 1e-5, "AdamW epsilon", minimum=0),
        "weight_decay": Key(float, 0.1, "decoupled weight decay (not on biases, norms)", minimum=0),
        "max_grad_norm": Key(float, 1.0, "global gradient-norm clip", minimum=0),
        "gradient_accumulation": Key(int, 1, "micro-batches per optimizer step per replica", minimum=1),
    },
    "training": {
        "max_steps": Key(int, 100, "optimizer steps to run (the budget)", minimum=1),
        "max_seconds": Key(
            float, None, "stop (and checkpoint) after this wall time", optional=True, minimum=0
        ),
        "seed": Key(int, 42, "model init", minimum=0),
        "precision": Key(str, "fp32", "fp32 | bf16 autocast", PRECISIONS),
        "checkpoint_every_steps": Key(int, 0, "0 = only at the end and on SIGTERM", minimum=0),
        "keep_checkpoints": Key(int, 2, "newest checkpoints kept", minimum=1),
        "log_every_steps": Key(int, 1, "metrics line every N steps", minimum=1),
        "compile": Key(
            bool,
            False,
            "torch.compile the training forward: one graph for the run (every micro-batch is "
            "[micro_batch_rows, S]; compiled, the packed attention takes the row's mask and the LM "
            "head runs on every token)",
        ),
        "compile_backend": Key(
            str, "inductor", "torch.compile's backend", ("inductor", "aot_eager", "eager")
        ),
    },
    "eval": {
        "every_samples": Key(
            int, None, "evaluate every N samples; null = only at the end", optional=True, minimum=1
        ),
        "rows": Key(int, 1024, "evaluation rows (MLPerf: 1024)", minimum=1),
        "target_log_perplexity": Key(float, 3.3, "stop when eval log perplexity reaches this", minimum=0),
        "stop_at_target": Key(bool, True, "end the run (status success) at the target"),
    },
    "execution": {
        "device": Key(str, "cpu", "where to train (IPUs: BERT only)", DEVICES),
        "threads": Key(int, None, "CPU threads per process; null = torch default", optional=True, minimum=1),
        "distributed_backend": Key(
            str, None, "torchrun backend; null = nccl on CUDA, gloo on CPU", ("nccl", "gloo"), optional=True
        ),  # fmt: skip
        "sharding": Key(
            str,
            "none",
            "none: every replica holds the whole model (DDP-style sums); fsdp: FSDP2, parameters, "
            "gradients and AdamW state split over the processes, checkpoints through DCP",
            ("none", "fsdp"),
        ),  # fmt: skip
        "activation_checkpointing": Key(
            bool, False, "recompute each block's activations in the backward (less memory, ~1/3 more compute)"
        ),
    },
    # BERT pretraining's logging keys (the same Reporter and MLPerf log read them), without its
    # tqdm bar: the decoder loop logs a line per window and draws none.
    "logging": {name: key for name, key in BERT_SCHEMA["logging"].items() if name != "progress"},
}


# The MLPerf division a run may call itself, by the layout of the rows it trains on. The Closed
# division requires the reference's training method, and MLPerf's llama31_8b reference (and
# NVIDIA's 5.1 submission) concatenates C4 documents and cuts every 8,192 tokens with plain
# causal attention across documents: the concatenated layout. Document-masked packs change what
# the model attends to: an Open-division method.
DIVISIONS_OF_LAYOUT: dict[str, tuple[str, ...]] = {
    "concatenated": ("closed", "open"),
    "documents": ("open",),
}


def division_fault(division: str, layout: str) -> str | None:
    """Why a run on `layout` rows cannot be logged as `division` (None: it can)."""
    if division in DIVISIONS_OF_LAYOUT[layout]:
        return None
    return (
        f"logging.submission_division {division}: the training rows are {layout}-layout packs, "
        f"a method of the {' or '.join(DIVISIONS_OF_LAYOUT[layout])} division only; MLPerf's Closed division "
        "trains as the reference does, on the concatenated layout (pack-documents' concatenated/train): "
        "train on those rows, or set logging.submission_division: open"
    )


def is_decoder_config(raw) -> bool:
    """Whether a raw config is a decoder pretraining config (its model section names a family)."""
    return isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "family" in raw["model"]


def validate(raw: dict, source: str = "config") -> dict:
    """Merge `raw` over the defaults and check every key; the resolved config."""
    resolved = resolve(raw, source, SCHEMA)
    device = resolved["execution"]["device"]
    if device in ("ipu", "ipu-model"):
        raise ConfigError(
            f"{source}: execution.device {device}: the IPU backend pretrains BERT only; a decoder "
            f"(model.family {resolved['model']['family']}) runs on cpu or cuda"
        )
    if resolved["data"]["train_dir"] is None:
        raise ConfigError(f"{source}: data.train_dir: give the training rows (packed pack-documents' output)")
    optim = resolved["optim"]
    if optim["warmup_samples"] > optim["total_samples"]:
        raise ConfigError(
            f"{source}: optim.warmup_samples {optim['warmup_samples']} is past optim.total_samples"
        )
    return resolved


def load_decoder_config(raw: dict, assignments: list[str], source: str) -> dict:
    return validate(apply_overrides(raw, list(assignments), SCHEMA), source)
