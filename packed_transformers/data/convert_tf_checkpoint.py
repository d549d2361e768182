"""`python -m packed_transformers.data.convert_tf_checkpoint`: the MLPerf BERT starting checkpoint (TF1,
`model.ckpt-28252` + `bert_config.json`) -> a Hugging Face BERT folder that
`model.init_checkpoint` takes (config.json + model.safetensors, BertForPreTraining names).

Every variable of the checkpoint is accounted for: model variables are mapped (kernels
transposed to PyTorch's [out, in]); optimizer slots and counters (`.../adam_m`, `.../adam_v`,
`global_step`, loss-scale state) are skipped and counted; any other name, or a model variable
the checkpoint lacks, is an error that lists them. The config's sizes must match the shapes.

Reading a TF checkpoint needs TensorFlow: `pip install -r requirements-tf.txt` (a separate
environment: TensorFlow pins its own h5py). Also reads NVIDIA's converted PyTorch form of the
same checkpoint (`--from nvidia-pt`, a `{"model": state_dict}` file, loaded weights-only),
which needs torch instead.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from packed_transformers.common.cli import command_parser, refuse
from packed_transformers.common.files import atomic_folder, describe_os_error
from packed_transformers.common.install_advice import pip_install

SKIPPED = re.compile(
    r"(/adam_[mv]|/lamb_[mv]|/Momentum)$|^(global_step|good_steps|current_loss_scale|loss_scale)$"
)
LAYER = re.compile(r"^bert/encoder/layer_(\d+)/(.+)$")

# Per-layer TF1 names -> HF names (after "bert.encoder.layer.{i}.").
LAYER_NAMES = {
    "attention/self/query": "attention.self.query",
    "attention/self/key": "attention.self.key",
    "attention/self/value": "attention.self.value",
    "attention/output/dense": "attention.output.dense",
    "attention/output/LayerNorm": "attention.output.LayerNorm",
    "intermediate/dense": "intermediate.dense",
    "output/dense": "output.dense",
    "output/LayerNorm": "output.LayerNorm",
}
OTHER_NAMES = {
    "bert/embeddings/word_embeddings": "bert.embeddings.word_embeddings.weight",
    "bert/embeddings/position_embeddings": "bert.embeddings.position_embeddings.weight",
    "bert/embeddings/token_type_embeddings": "bert.embeddings.token_type_embeddings.weight",
    "bert/embeddings/LayerNorm": "bert.embeddings.LayerNorm",
    "bert/pooler/dense": "bert.pooler.dense",
    "cls/predictions/transform/dense": "cls.predictions.transform.dense",
    "cls/predictions/transform/LayerNorm": "cls.predictions.transform.LayerNorm",
    "cls/predictions/output_bias": "cls.predictions.bias",
    # TF computes logits = x @ output_weights^T: already PyTorch's [out, in], no transpose.
    "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",
    "cls/seq_relationship/output_bias": "cls.seq_relationship.bias",
}
LEAVES = {
    "kernel": ("weight", True),
    "bias": ("bias", False),
    "gamma": ("weight", False),
    "beta": ("bias", False),
}
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "initializer_range",
)


class ConversionError(ValueError):
    """A checkpoint or config that does not convert; printed as one line, exit 2."""


def hf_name(tf_name: str) -> tuple[str, bool] | None:
    """TF1 variable name -> (HF name, transpose?), or None for a name we do not know."""
    match = LAYER.match(tf_name)
    prefix, rest = "", tf_name
    if match:
        prefix, rest = f"bert.encoder.layer.{match.group(1)}.", match.group(2)
        table = LAYER_NAMES
    else:
        table = OTHER_NAMES
    if rest in table and table[rest].endswith((".weight", ".bias")):
        return prefix + table[rest], False
    module, _, leaf = rest.rpartition("/")
    if module in table and leaf in LEAVES:
        suffix, transpose = LEAVES[leaf]
        return f"{prefix}{table[module]}.{suffix}", transpose
    return None


def expected_names(config: dict) -> set[str]:
    names = {
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.embeddings.LayerNorm.bias",
        "bert.pooler.dense.weight",
        "bert.pooler.dense.bias",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.LayerNorm.bias",
        "cls.predictions.bias",
        "cls.seq_relationship.weight",
        "cls.seq_relationship.bias",
    }
    for i in range(config["num_hidden_layers"]):
        for module in LAYER_NAMES.values():
            names |= {f"bert.encoder.layer.{i}.{module}.weight", f"bert.encoder.layer.{i}.{module}.bias"}
    return names


def expected_shapes(config: dict) -> dict[str, tuple]:
    """The shape of every variable of `expected_names(config)` (HF layout: Linear weights
    [out, in]): all of them are checked, so a [64, 32] query kernel is refused here, not at
    training start."""
    h, v, f = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    shapes = {
        "bert.embeddings.word_embeddings.weight": (v, h),
        "bert.embeddings.position_embeddings.weight": (config["max_position_embeddings"], h),
        "bert.embeddings.token_type_embeddings.weight": (config["type_vocab_size"], h),
        "bert.embeddings.LayerNorm.weight": (h,),
        "bert.embeddings.LayerNorm.bias": (h,),
        "bert.pooler.dense.weight": (h, h),
        "bert.pooler.dense.bias": (h,),
        "cls.predictions.transform.dense.weight": (h, h),
        "cls.predictions.transform.dense.bias": (h,),
        "cls.predictions.transform.LayerNorm.weight": (h,),
        "cls.predictions.transform.LayerNorm.bias": (h,),
        "cls.predictions.bias": (v,),
        "cls.seq_relationship.weight": (2, h),
        "cls.seq_relationship.bias": (2,),
    }
    per_module = {"intermediate.dense": ((f, h), (f,)), "output.dense": ((h, f), (h,))}
    for i in range(config["num_hidden_layers"]):
        for module in LAYER_NAMES.values():
            weight, bias = per_module.get(module, ((h,), (h,)) if "LayerNorm" in module else ((h, h), (h,)))
            shapes[f"bert.encoder.layer.{i}.{module}.weight"] = weight
            shapes[f"bert.encoder.layer.{i}.{module}.bias"] = bias
    return shapes


def read_bert_config(path: Path) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConversionError(f"--bert-config {path}: not a readable JSON file ({err})") from None
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ConversionError(
            f"--bert-config {path}: key {missing[0]!r} is missing (a BERT bert_config.json has {', '.join(CONFIG_KEYS)})"
        )
    return config


def read_tf_checkpoint(prefix: str) -> dict[str, np.ndarray]:
    try:
        import tensorflow as tf
    except ImportError as err:
        raise ConversionError(
            f"reading a TF checkpoint needs TensorFlow: {pip_install('tensorflow')}, best in an environment of "
            f"its own (it pins its own h5py; in a clone: make install-tf) ({err})"
        ) from None
    try:
        reader = tf.train.load_checkpoint(prefix)
    except Exception as err:  # TF raises NotFoundError / DataLossError / ValueError
        raise ConversionError(
            f"--checkpoint {prefix}: not a readable TF checkpoint ({str(err).splitlines()[0]})"
        ) from None
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def read_nvidia_checkpoint(path: str) -> dict[str, np.ndarray]:
    """NVIDIA's MLPerf PyTorch form: {"model": state_dict} (or the bare state dict), HF-like
    names, Linear weights already [out, in]; returned under TF1 names so one check covers both."""
    import torch

    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConversionError(
            f"--checkpoint {path}: not a weights-only PyTorch file ({str(err).splitlines()[0]})"
        ) from None
    state = blob.get("model", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict):
        raise ConversionError(f"--checkpoint {path}: expected a state dict or {{'model': state dict}}")
    return {name.removeprefix("module."): value.float().numpy() for name, value in state.items()}


def convert(
    variables: dict[str, np.ndarray], config: dict, source: str
) -> tuple[dict[str, np.ndarray], dict]:
    """-> (HF tensors, report). `source` is "tf" (TF1 names) or "nvidia-pt" (HF-like names)."""
    tensors, skipped, unknown = {}, [], []
    for name, value in sorted(variables.items()):
        if source == "tf":
            if SKIPPED.search(name):
                skipped.append(name)
                continue
            mapped = hf_name(name)
            if mapped is None:
                unknown.append(name)
                continue
            target, transpose = mapped
            value = value.T if transpose else value
        else:
            target = name
            if target in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"):
                skipped.append(name)  # tied to the word embeddings / to cls.predictions.bias
                continue
            if target.endswith("position_ids"):
                skipped.append(name)
                continue
        tensors[target] = np.ascontiguousarray(value, dtype=np.float32)
    expected = expected_names(config)
    # Both paths: a name the config has no place for (a layer beyond num_hidden_layers) is
    # refused, never dropped: a 3-layer checkpoint with a 2-layer config is a mismatch.
    unknown += [name for name in tensors if name not in expected]
    if unknown:
        raise ConversionError(
            f"{len(unknown)} variable(s) of the checkpoint have no place in BERT: {', '.join(unknown[:10])}"
        )
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ConversionError(
            f"the checkpoint lacks {len(missing)} BERT variable(s): {', '.join(missing[:10])}"
        )
    for name, shape in expected_shapes(config).items():
        if tensors[name].shape != shape:
            raise ConversionError(f"{name}: shape {tensors[name].shape} does not match the config's {shape}")
    return tensors, {"mapped": len(tensors), "skipped": len(skipped), "skipped_names": skipped[:20]}


def hf_config(config: dict) -> dict:
    out = {key: config[key] for key in CONFIG_KEYS}
    out.update(model_type="bert", architectures=["BertForPreTraining"], layer_norm_eps=1e-12, pad_token_id=0)
    return out


def write_folder(output: Path, tensors: dict, config: dict, report: dict) -> None:
    from safetensors.numpy import save_file

    with atomic_folder(output) as tmp:
        try:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        except OSError:
            raise
        except Exception as err:  # safetensors wraps a failed write in SafetensorError
            raise ConversionError(
                f"{output}: writing model.safetensors failed ({err}; no space left on the device or a "
                "file-size limit?)"
            ) from None
        (tmp / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
        (tmp / "conversion.json").write_text(json.dumps(report, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m packed_transformers.data.convert_tf_checkpoint", __doc__)
    p.add_argument("--checkpoint", required=True, help="TF1 prefix (model.ckpt-28252) or NVIDIA .pt file")
    p.add_argument("--bert-config", required=True, type=Path, help="the checkpoint's bert_config.json")
    p.add_argument("--output", required=True, type=Path, metavar="DIR", help="the HF folder to write")
    p.add_argument("--from", dest="source", choices=("tf", "nvidia-pt"), default="tf")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.output.exists():
            raise ConversionError(f"--output {args.output} exists; choose a new folder")
        config = read_bert_config(args.bert_config)
        reader = read_tf_checkpoint if args.source == "tf" else read_nvidia_checkpoint
        variables = reader(args.checkpoint)
        tensors, report = convert(variables, config, args.source)
        report.update(checkpoint=str(args.checkpoint), source=args.source)
        write_folder(args.output, tensors, config, report)
    except ConversionError as err:
        return refuse(err)
    except OSError as err:  # an unreadable checkpoint, a full disk, an unwritable --output
        return refuse(describe_os_error(err))
    print(json.dumps({k: v for k, v in report.items() if k != "skipped_names"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
