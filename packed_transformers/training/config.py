"""Pretraining run configuration: the schema of `run_pretraining.py`'s YAML files.

A config is YAML with the sections below. Every key has a type, a default, a check and a
one-line description (configs/README.md is generated from SCHEMA by
`python -m packed_transformers.training.config --markdown`). The machinery (loading, `--set`, checks) is
common.config_schema's.
"""

from __future__ import annotations

import sys

from packed_transformers.common.config_schema import (
    ConfigError,
    Key,
    apply_overrides,
    markdown,
    read_yaml,
    resolve,
)
from packed_transformers.common.constants import BERT_VOCAB_SIZE
from packed_transformers.model.config import ATTENTION_BACKENDS, MLM_LOSS_MODES, PRESETS
from packed_transformers.optim import PACKING_ADJUSTMENTS

__all__ = ["SCHEMA", "ConfigError", "load_config", "validate"]

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda", "ipu", "ipu-model")

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "preset": Key(str, "bert-large", "architecture preset", tuple(PRESETS)),
        "init_checkpoint": Key(
            str, None, "Hugging Face BERT folder to start from (phase 2 starts from phase 1)", optional=True
        ),
        "attention_backend": Key(str, "varlen", "block-diagonal attention kernel", ATTENTION_BACKENDS),
        "mlm_loss_mode": Key(str, "per_token", "MLM loss normalisation", MLM_LOSS_MODES),
        "recompute_layers": Key(bool, False, "activation checkpointing of every encoder layer"),
        "hidden_dropout": Key(float, 0.1, "dropout after attention and FFN", minimum=0, maximum=1),
        "attention_dropout": Key(float, 0.1, "dropout on attention probabilities", minimum=0, maximum=1),
        "vocab_size": Key(int, BERT_VOCAB_SIZE, "vocabulary size (random init only)", minimum=1),
    },
    "data": {
        "train_dir": Key(
            str,
            None,
            "packed training data (metadata.json + part-*.h5); not read when synthetic",
            optional=True,
        ),
        "eval_dir": Key(str, None, "packed evaluation data; null = no evaluation", optional=True),
        "micro_batch_packs": Key(int, 8, "packs per replica per forward pass", minimum=1),
        "check_sha256": Key(
            bool,
            True,
            "check every shard's sha256 against metadata.json before training (reads the data once)",
        ),
        "loader_workers": Key(int, 2, "DataLoader worker processes per replica", minimum=0),
        "shuffle_seed": Key(int, 12345, "seed of the per-epoch pack order", minimum=0),
        "max_sequences_per_pack": Key(
            int, None, "expected K of the data (checked against metadata.json)", optional=True, minimum=1
        ),
        "max_sequence_length": Key(
            int, 512, "expected S of the data (checked against metadata.json)", minimum=1
        ),
        "validate_batches": Key(bool, False, "check every batch against the packed format (debugging)"),
        "synthetic": Key(
            bool,
            False,
            "throughput check: random packs made in memory (S, K from this section), no data read; "
            "on IPUs no host I/O at all; no evaluation, no MLPerf log",
        ),
        "synthetic_packing_factor": Key(
            float, 2.0, "mean sequences per synthetic pack (at most max_sequences_per_pack)", minimum=1
        ),
    },
    "optim": {
        "lr": Key(float, 4e-4, "peak learning rate", minimum=0),
        "warmup_samples": Key(float, 0.0, "linear warmup length, in sequences", minimum=0),
        "total_samples": Key(float, 1e7, "polynomial decay length, in sequences", minimum=1),
        "start_offset_samples": Key(
            float, 0.0, "schedule offset (<= 0: warmup partly done, NVIDIA style)", maximum=0
        ),
        "poly_power": Key(float, 1.0, "polynomial decay power", minimum=0),
        "end_lr": Key(float, 0.0, "learning rate at total_samples", minimum=0),
        "betas": Key("betas", [0.9, 0.999], "LAMB (beta1, beta2) before the packing adjustment"),
        "eps": Key(float, 1e-6, "LAMB epsilon", minimum=0),
        "weight_decay": Key(float, 0.01, "decoupled weight decay (not on biases, LayerNorm)", minimum=0),
        "bias_correction": Key(bool, True, "Adam-style bias correction of the moments"),
        "max_grad_norm": Key(float, 1.0, "global gradient-norm clip; null = none", optional=True, minimum=0),
        "gradient_accumulation": Key(
            int, 1, "micro-batches per optimizer step per replica, before adjustment", minimum=1
        ),
        "packing_adjustment": Key(
            str, "same_sequences_per_step", "how packing changes GA / betas", PACKING_ADJUSTMENTS
        ),
    },
    "training": {
        "on_nonfinite": Key(
            str,
            "stop",
            "a step with a non-finite loss or gradient norm: stop the run, or skip the step",
            ("stop", "skip"),
        ),
        "max_skipped_steps": Key(
            int, 10, "with on_nonfinite skip: stop after this many skipped steps", minimum=0
        ),
        "max_steps": Key(int, 100, "optimizer steps to run (the budget)", minimum=1),
        "max_samples": Key(
            float, None, "stop after this many sequences; null = no limit", optional=True, minimum=1
        ),
        "seed": Key(int, 42, "model init, dropout", minimum=0),
        "precision": Key(str, "fp32", "fp32 | bf16 autocast | fp16 autocast + loss scaling", PRECISIONS),
        "compile": Key(bool, False, "torch.compile the model (CUDA)"),
        "checkpoint_every_steps": Key(int, 0, "0 = only at the end and on SIGTERM", minimum=0),
        "keep_checkpoints": Key(int, 2, "newest checkpoints kept", minimum=1),
        "log_every_steps": Key(int, 1, "metrics line every N steps", minimum=1),
        "max_seconds": Key(
            float, None, "stop (and checkpoint) after this wall time", optional=True, minimum=0
        ),
        "max_train_seconds": Key(
            float,
            None,
            "stop after this much training time (evaluations and checkpoints not counted; "
            "equal-time comparisons)",
            optional=True,
            minimum=0,
        ),
    },
    "eval": {
        "every_samples": Key(
            float,
            None,
            "evaluate every N sequences; null = MLPerf floor(0.05*(230.23*GBS+3e6)/25000)*25000",
            optional=True,
            minimum=1,
        ),
        "max_sequences": Key(int, 10000, "held-out sequences per evaluation", minimum=1),
        "target_mlm_accuracy": Key(
            float, 0.720, "stop when eval MLM accuracy reaches this", minimum=0, maximum=1
        ),
        "stop_at_target": Key(bool, True, "end the run (status success) at the target"),
        "at_end": Key(bool, True, "evaluate once more when the budget ends"),
    },
    "execution": {
        "device": Key(str, "cpu", "where to train", DEVICES),
        "threads": Key(
            int, None, "CPU threads per process; null = torch default", optional=True, minimum=1, maximum=1024
        ),
        "distributed_backend": Key(
            str, None, "torchrun backend; null = nccl on CUDA, gloo on CPU", ("nccl", "gloo"), optional=True
        ),
        "sharding": Key(
            str,
            "none",
            "none: every replica holds the whole model (DDP); fsdp: FSDP2, each encoder layer and the "
            "model sharded over the processes (torchrun), the checkpoint's format unchanged",
            ("none", "fsdp"),
        ),
        "layers_per_stage": Key(
            "int_list",
            None,
            "encoder layers per pipeline stage, e.g. [3, 7, 7, 7]; embeddings go to the first stage, "
            "heads to the last (torch) or IPU 0 (ipu); null = no pipeline",
            optional=True,
        ),
        "compile_only": Key(
            bool,
            False,
            "compile the IPU executables (timed, into ipu.executable_cache_dir) and stop; "
            "run_pretraining.py --compile-only",
        ),
        "pipeline_schedule": Key(
            str, "1f1b", "torch pipeline micro-batch schedule", ("gpipe", "1f1b"), optional=False
        ),
    },
    "ipu": {
        "replicas": Key(int, 1, "model replicas in total (all poprun instances together)", minimum=1),
        "ipus_per_replica": Key(int, 4, "IPUs one replica is pipelined over", minimum=1),
        "device_iterations": Key(int, 1, "optimizer steps per host call (one lr per call)", minimum=1),
        "output_mode": Key(
            str, "sum", "what returns to the host: sums over the call, or every micro-batch", ("sum", "all")
        ),
        "executable_cache_dir": Key(str, None, "compiled executable cache; null = none", optional=True),
        "available_memory_proportion": Key(
            "float_list",
            None,
            "per-IPU matmul temporary-memory proportion; null = SDK default",
            optional=True,
        ),
        "half": Key(bool, True, "fp16 weights and activations (model.half())"),
        "loss_scaling": Key(float, 1.0, "static loss scale of poptorch.optim.LAMB", minimum=0),
        "stochastic_rounding": Key(bool, True, "stochastic rounding of fp16 arithmetic"),
        "half_partials": Key(bool, False, "fp16 partials in matmuls"),
        "replicated_tensor_sharding": Key(bool, True, "shard optimizer state over replicas"),
        "optimizer_state_offchip": Key(bool, False, "optimizer state in streaming memory"),
        "embedding_serialization_factor": Key(
            int,
            1,
            "MLM decoder matmul split into this many over the vocabulary (serializedMatMul)",
            minimum=1,
        ),
        "onehot_gather": Key(
            bool, True, "gather masked and [CLS] rows as one-hot matmuls (Graphcore's BERT)"
        ),
        "popart_performance_options": Key(
            bool, True, "Graphcore BERT's PopART options (tied gather, outer-fragment schedule, JIT copies)"
        ),
        "recompute_checkpoints": Key(bool, True, "recomputation checkpoint after every encoder layer"),
        "optimizer_accum_type": Key(
            str, "float32", "LAMB accumulator and moment type", ("float32", "float16")
        ),
    },
    "logging": {
        "progress": Key(bool, True, "tqdm progress bar"),
        "tensorboard": Key(bool, True, "TensorBoard event files in OUTPUT/tensorboard"),
        "mlperf": Key(bool, True, "MLPerf log lines (mlperf-logging) in OUTPUT/mlperf.log"),
        "submission_org": Key(str, "unknown", "MLPerf log: submitting organisation"),
        "submission_division": Key(str, "closed", "MLPerf log: division", ("closed", "open")),
        "submission_status": Key(
            str, "research", "MLPerf log: system status", ("onprem", "cloud", "preview", "research")
        ),
        "submission_platform": Key(
            str, None, "MLPerf log: platform; null = '<replicas>x<device name>'", optional=True
        ),
    },
}


def validate(raw: dict, source: str = "config") -> dict:
    """Merge `raw` over the pretraining defaults and check every key. Returns the resolved config."""
    resolved = resolve(raw, source, SCHEMA)
    data = resolved["data"]
    if data["synthetic"]:
        if data["eval_dir"] is not None:
            raise ConfigError(
                f"{source}: data.eval_dir: evaluation measures nothing on synthetic data (data.synthetic "
                "is true); set data.eval_dir null"
            )
        if resolved["logging"]["mlperf"]:
            raise ConfigError(
                f"{source}: logging.mlperf: a synthetic-data run must not write an MLPerf log; set it false"
            )
        k = data["max_sequences_per_pack"]
        if k is None:
            raise ConfigError(f"{source}: data.max_sequences_per_pack: synthetic packs need K; give it")
        if data["max_sequence_length"] < 8 * k:  # components.synthetic: every sequence >= 8 tokens
            raise ConfigError(
                f"{source}: data.max_sequence_length {data['max_sequence_length']} is too short for "
                f"data.max_sequences_per_pack {k} synthetic sequences of at least 8 tokens (needs >= {8 * k})"
            )
        if data["synthetic_packing_factor"] > k:
            raise ConfigError(
                f"{source}: data.synthetic_packing_factor {data['synthetic_packing_factor']} is more than "
                f"data.max_sequences_per_pack {k}"
            )
    if resolved["execution"]["compile_only"] and resolved["execution"]["device"] not in ("ipu", "ipu-model"):
        raise ConfigError(
            f"{source}: execution.compile_only: only PopTorch compiles ahead of time; execution.device is "
            f"{resolved['execution']['device']!r} (use ipu or ipu-model)"
        )
    execution = resolved["execution"]
    if execution["sharding"] == "fsdp":
        clash = (
            "execution.device " + execution["device"] if execution["device"] in ("ipu", "ipu-model")
            else "execution.layers_per_stage" if execution["layers_per_stage"] and len(execution["layers_per_stage"]) > 1
            else "training.compile" if resolved["training"]["compile"]
            else "training.precision fp16" if resolved["training"]["precision"] == "fp16"
            else None
        )  # fmt: skip
        if clash:
            raise ConfigError(
                f"{source}: execution.sharding fsdp: not with {clash} (FSDP2 shards the torch engine's "
                "replicas on cpu or cuda, fp32 or bf16, uncompiled)"
            )
    if not data["synthetic"] and data["train_dir"] is None:
        raise ConfigError(
            f"{source}: data.train_dir: give the packed training data (or data.synthetic: true)"
        )
    if resolved["training"]["precision"] == "fp16" and resolved["execution"]["device"] == "cpu":
        raise ConfigError(
            "training.precision: fp16 with loss scaling needs execution.device cuda (use bf16 or fp32)"
        )
    return resolved


def load_config(path, assignments: list[str] = ()) -> dict:
    return validate_raw(read_yaml(path), assignments, path)


def validate_raw(raw: dict, assignments, path) -> dict:
    """A config already read (read_yaml) with `--set` assignments applied, checked."""
    return validate(apply_overrides(raw, list(assignments), SCHEMA), str(path))


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown(SCHEMA))
