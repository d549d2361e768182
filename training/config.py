"""Run configuration: the schema, YAML loading, `--set` overrides and validation.

A config is YAML with the sections below. Every key has a type, a default, a check and a
one-line description (configs/README.md is generated from SCHEMA by
`python -m training.config --markdown`). Validation runs before any data is read or
model built: an unknown key names the closest valid key, a bad value names its key.
"""

from __future__ import annotations

import copy
import difflib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot run; the message names the key. CLI exit code 2."""


@dataclass(frozen=True)
class Key:
    kind: Any  # int, float, bool, str, "betas", "int_list", "float_list", "str_list"
    default: Any
    doc: str
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False  # None allowed


PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda", "ipu", "ipu-model")
ADJUSTMENTS = ("none", "same_sequences_per_step", "same_packs_per_step")

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "preset": Key(
            str, "bert-large", "architecture preset", ("bert-large", "bert-base", "bert-mini", "bert-tiny")
        ),
        "init_checkpoint": Key(
            str, None, "Hugging Face BERT folder to start from (phase 2 starts from phase 1)", optional=True
        ),
        "attention_backend": Key(str, "sdpa", "block-diagonal attention kernel", ("dense", "sdpa", "flex")),
        "mlm_loss_mode": Key(str, "per_token", "MLM loss normalisation", ("per_token", "per_sequence")),
        "recompute_layers": Key(bool, False, "activation checkpointing of every encoder layer"),
        "hidden_dropout": Key(float, 0.1, "dropout after attention and FFN", minimum=0, maximum=1),
        "attention_dropout": Key(float, 0.1, "dropout on attention probabilities", minimum=0, maximum=1),
        "vocab_size": Key(int, 30522, "vocabulary size (random init only)", minimum=1),
    },
    "data": {
        "train_dir": Key(str, None, "packed training data (metadata.json + part-*.h5)"),
        "eval_dir": Key(str, None, "packed evaluation data; null = no evaluation", optional=True),
        "micro_batch_packs": Key(int, 8, "packs per replica per forward pass", minimum=1),
        "loader_workers": Key(int, 2, "DataLoader worker processes per replica", minimum=0),
        "shuffle_seed": Key(int, 12345, "seed of the per-epoch pack order", minimum=0),
        "max_sequences_per_pack": Key(
            int, None, "expected K of the data (checked against metadata.json)", optional=True, minimum=1
        ),
        "max_sequence_length": Key(
            int, 512, "expected S of the data (checked against metadata.json)", minimum=1
        ),
        "validate_batches": Key(bool, False, "check every batch against the packed format (debugging)"),
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
            str, "same_sequences_per_step", "how packing changes GA / betas", ADJUSTMENTS
        ),
    },
    "training": {
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
        "threads": Key(int, None, "CPU threads per process; null = torch default", optional=True, minimum=1),
        "distributed_backend": Key(
            str, None, "torchrun backend; null = nccl on CUDA, gloo on CPU", ("nccl", "gloo"), optional=True
        ),
        "layers_per_stage": Key(
            "int_list",
            None,
            "encoder layers per pipeline stage, e.g. [3, 7, 7, 7]; embeddings go to the first stage, "
            "heads to the last (torch) or IPU 0 (ipu); null = no pipeline",
            optional=True,
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
        "recompute_checkpoints": Key(bool, True, "recomputation checkpoint after every encoder layer"),
        "optimizer_accum_type": Key(
            str, "float32", "LAMB accumulator and moment type", ("float32", "float16")
        ),
    },
    "logging": {
        "progress": Key(bool, True, "tqdm progress bar"),
        "tensorboard": Key(bool, True, "TensorBoard event files in OUTPUT/tensorboard"),
        "mlperf": Key(bool, True, "MLPerf log lines (mlperf-logging) in OUTPUT/mlperf.log"),
    },
}


def defaults(schema: dict = SCHEMA) -> dict:
    return {
        section: {k: copy.deepcopy(v.default) for k, v in keys.items()} for section, keys in schema.items()
    }


def _closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.4)
    return f"; did you mean '{match[0]}'?" if match else f"; valid: {', '.join(sorted(options))}"


# Names users bring from other trainers -> ours.
ALIASES = {
    "learning_rate": "lr",
    "batch_size": "micro_batch_packs",
    "micro_batch_size": "micro_batch_packs",
    "num_workers": "loader_workers",
    "grad_accum": "gradient_accumulation",
    "gradient_accumulation_steps": "gradient_accumulation",
    "steps": "max_steps",
    "train_steps": "max_steps",
}


def _suggest(section: str, name: str, schema: dict = SCHEMA) -> str:
    """'; did you mean ...' for an unknown key: an alias, a near spelling in the section, or anywhere."""
    keys = schema[section]
    if ALIASES.get(name) in keys:
        return f"; did you mean '{section}.{ALIASES[name]}'?"
    match = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.6)
    if match:
        return f"; did you mean '{section}.{match[0]}'?"
    return _closest(f"{section}.{name}", _all_keys(schema))


def _all_keys(schema: dict = SCHEMA) -> list[str]:
    return [f"{s}.{k}" for s, keys in schema.items() for k in keys]


def _check_value(path: str, key: Key, value):
    if value is None:
        # A key without a default is required: `resolve` names it when it is still unset.
        if key.optional or key.default is None:
            return None
        raise ConfigError(f"{path}: must be set (got null)")
    if key.kind in ("int_list", "float_list"):
        item = Key(int if key.kind == "int_list" else float, 0, "", minimum=0)
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"{path}: expected a non-empty list of numbers, got {value!r}")
        return [_check_value(path, item, v) for v in value]
    if key.kind == "str_list":
        if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a non-empty list of strings, got {value!r}")
        return list(value)
    if key.kind == "betas":
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ConfigError(f"{path}: expected a list of two numbers in [0, 1), got {value!r}")
        out = [_check_value(path, Key(float, 0, "", minimum=0, maximum=0.999999999), v) for v in value]
        return out
    if key.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if key.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
    elif key.kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path}: must be finite, got {value!r}")
    elif key.kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, key.choices))}")
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{path}: must be >= {key.minimum}, got {value!r}")
    if key.maximum is not None and value > key.maximum:
        raise ConfigError(f"{path}: must be <= {key.maximum}, got {value!r}")
    return value


def resolve(raw: dict, source: str, schema: dict) -> dict:
    """Merge `raw` over `schema`'s defaults and check every key; required keys (no default,
    not optional) must be set. Shared by every command's schema."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    resolved = defaults(schema)
    for section, values in raw.items():
        if section not in schema:
            raise ConfigError(f"{source}: unknown section '{section}'{_closest(section, schema)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping")
        for name, value in values.items():
            if name not in schema[section]:
                raise ConfigError(
                    f"{source}: unknown key '{section}.{name}'" + _suggest(section, name, schema)
                )
            resolved[section][name] = _check_value(f"{section}.{name}", schema[section][name], value)
    for section, keys in schema.items():
        for name, key in keys.items():
            if key.default is None and not key.optional and resolved[section][name] is None:
                raise ConfigError(f"{source}: {section}.{name} must be set ({key.doc})")
    return resolved


def validate(raw: dict, source: str = "config") -> dict:
    """Merge `raw` over the pretraining defaults and check every key. Returns the resolved config."""
    resolved = resolve(raw, source, SCHEMA)
    if resolved["training"]["precision"] == "fp16" and resolved["execution"]["device"] == "cpu":
        raise ConfigError(
            "training.precision: fp16 with loss scaling needs execution.device cuda (use bf16 or fp32)"
        )
    return resolved


def apply_overrides(raw: dict, assignments: list[str], schema: dict = SCHEMA) -> dict:
    """`section.key=value` strings (values parsed as YAML) applied to a raw config."""
    raw = copy.deepcopy(raw)
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        path, text = item.split("=", 1)
        if path.count(".") != 1:
            raise ConfigError(
                f"--set {item!r}: expected section.key=value{_closest(path, _all_keys(schema))}"
            )
        section, name = path.split(".")
        if section not in schema:
            raise ConfigError(f"--set: unknown section in '{path}'{_closest(path, _all_keys(schema))}")
        if name not in schema[section]:
            raise ConfigError(f"--set: unknown key '{path}'{_suggest(section, name, schema)}")
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][name] = yaml.safe_load(text)
    return raw


def read_yaml(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None


def load_config(path, assignments: list[str] = ()) -> dict:
    raw = read_yaml(path)
    return validate(apply_overrides(raw, list(assignments)), str(path))


def markdown(schema: dict = SCHEMA) -> str:
    lines = []
    for section, keys in schema.items():
        lines += [f"### `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, key in keys.items():
            kind = key.kind if isinstance(key.kind, str) else key.kind.__name__
            if key.choices:
                kind = " \\| ".join(map(str, key.choices))
            lines.append(f"| `{name}` | {kind} | `{key.default}` | {key.doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown())
