"""From a validated config to the objects a run needs: data, model, optimizer, schedule.

Every check that can fail on user input happens here, before any compute, and raises
RunError with the file or key to fix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from packed_transformers.components.errors import RunError
from packed_transformers.model import PackedBertForPreTraining, bert_config
from packed_transformers.model.hf_checkpoint import SHAPE_FIELDS
from packed_transformers.model.opening import check_finite_weights
from packed_transformers.optim import WarmupPolyDecay, packing_factor_from_metadata
from packed_transformers.packing.shards import PackedDataset
from packed_transformers.packs.errors import PackingInputError


def open_packed(folder, config: dict, role: str) -> PackedDataset:
    try:
        dataset = PackedDataset.open(folder)
    except PackingInputError as err:
        raise RunError(f"data.{role}_dir: {err}") from None
    meta = dataset.metadata
    s = config["data"]["max_sequence_length"]
    if meta["S"] != s:
        raise RunError(
            f"data.{role}_dir {folder}: S={meta['S']} in metadata.json, data.max_sequence_length is {s}"
        )
    k = config["data"]["max_sequences_per_pack"]
    if role == "train" and k is not None and meta["K"] != k:
        raise RunError(
            f"data.{role}_dir {folder}: K={meta['K']} in metadata.json, data.max_sequences_per_pack is {k}"
        )
    if dataset.packs < 1:
        raise RunError(f"data.{role}_dir {folder}: holds no pack")
    try:  # before any compute: a truncated, edited or bit-flipped shard is refused here
        dataset.check_contents(sha256=config["data"]["check_sha256"])
    except PackingInputError as err:
        raise RunError(f"data.{role}_dir: {err}") from None
    return dataset


def build_model(config: dict, seed: int) -> PackedBertForPreTraining:
    model_cfg = config["model"]
    options = dict(
        attention_backend=model_cfg["attention_backend"],
        mlm_loss_mode=model_cfg["mlm_loss_mode"],
        recompute_layers=model_cfg["recompute_layers"],
        hidden_dropout_prob=model_cfg["hidden_dropout"],
        attention_probs_dropout_prob=model_cfg["attention_dropout"],
    )
    torch.manual_seed(seed)
    if model_cfg["init_checkpoint"] is None:
        return PackedBertForPreTraining(
            bert_config(model_cfg["preset"], vocab_size=model_cfg["vocab_size"], **options)
        )
    folder = Path(model_cfg["init_checkpoint"])
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise RunError(
            f"model.init_checkpoint {folder}: no config.json (expected a Hugging Face BERT folder)"
        )
    found = json.loads(config_file.read_text())
    wanted = bert_config(model_cfg["preset"])
    for key in SHAPE_FIELDS:
        if key == "vocab_size":
            continue
        if key in found and found[key] != getattr(wanted, key):
            raise RunError(
                f"model.init_checkpoint {folder}: {key}={found[key]} does not fit model.preset "
                f"{model_cfg['preset']} ({key}={getattr(wanted, key)})"
            )
    try:
        model = PackedBertForPreTraining.from_pretrained(folder, **options)
        check_finite_weights(folder, model)  # the door's check: a NaN start trains nothing (NonFiniteWeights)
        return model
    except (OSError, ValueError, RuntimeError) as err:
        raise RunError(f"model.init_checkpoint {folder}: cannot be loaded ({err})") from None


def check_model_fits_data(model, dataset: PackedDataset, which: str = "data.train_dir") -> None:
    """RunError, before any compute, if `dataset` (the training or the evaluation data:
    `which` names its key) holds positions or token ids the model has no embedding for."""
    meta = dataset.metadata
    if model.config.max_position_embeddings < meta["S"]:
        raise RunError(
            f"{which}: the data has S={meta['S']}, the model {model.config.max_position_embeddings} positions"
        )
    vocab = meta.get("vocab_size")
    if vocab is not None and vocab > model.config.vocab_size:
        raise RunError(
            f"{which}: the data was packed for a vocabulary of {vocab} tokens (packing's --vocab-size), "
            f"larger than the model's model.vocab_size {model.config.vocab_size}; set model.vocab_size to "
            f"{vocab} (or the init checkpoint's vocabulary), or pack with the vocabulary the model has"
        )


def mlperf_eval_interval(global_batch_sequences: float) -> int:
    """MLPerf BERT: evaluate every floor(0.05 * (230.23 * GBS + 3e6) / 25000) * 25000 samples."""
    return max(25000, int(math.floor(0.05 * (230.23 * global_batch_sequences + 3e6) / 25000) * 25000))


def build_schedule(config: dict) -> WarmupPolyDecay:
    """Learning rate as a function of sequences trained (the same for every backend)."""
    optim = config["optim"]
    return WarmupPolyDecay(
        peak_lr=optim["lr"],
        warmup_samples=optim["warmup_samples"],
        total_samples=optim["total_samples"],
        power=optim["poly_power"],
        end_lr=optim["end_lr"],
        start_offset_samples=optim["start_offset_samples"],
    )


def packing_factor(dataset: PackedDataset) -> float:
    return packing_factor_from_metadata(dataset.metadata)
