"""From a validated config to the objects a run needs: data, model, optimizer, schedule.

Every check that can fail on user input happens here, before any compute, and raises
RunError with the file or key to fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from model import PackedBertForPreTraining, bert_config
from model.hf_checkpoint import SHAPE_FIELDS
from optim import Lamb, WarmupPolyDecay, adjust_for_packing, packing_factor_from_metadata, weight_decay_groups
from packing.errors import PackingInputError
from packing.shards import PackedDataset


class RunError(ValueError):
    """A run that cannot start; the message says what to fix. CLI exit code 2."""


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
    return dataset


def build_model(config: dict, seed: int) -> PackedBertForPreTraining:
    m = config["model"]
    options = dict(
        attention_backend=m["attention_backend"],
        mlm_loss_mode=m["mlm_loss_mode"],
        recompute_layers=m["recompute_layers"],
        hidden_dropout_prob=m["hidden_dropout"],
        attention_probs_dropout_prob=m["attention_dropout"],
    )
    torch.manual_seed(seed)
    if m["init_checkpoint"] is None:
        return PackedBertForPreTraining(bert_config(m["preset"], vocab_size=m["vocab_size"], **options))
    folder = Path(m["init_checkpoint"])
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise RunError(
            f"model.init_checkpoint {folder}: no config.json (expected a Hugging Face BERT folder)"
        )
    found = json.loads(config_file.read_text())
    wanted = bert_config(m["preset"])
    for key in SHAPE_FIELDS:
        if key == "vocab_size":
            continue
        if key in found and found[key] != getattr(wanted, key):
            raise RunError(
                f"model.init_checkpoint {folder}: {key}={found[key]} does not fit model.preset "
                f"{m['preset']} ({key}={getattr(wanted, key)})"
            )
    try:
        return PackedBertForPreTraining.from_pretrained(folder, **options)
    except (OSError, ValueError, RuntimeError) as err:
        raise RunError(f"model.init_checkpoint {folder}: cannot be loaded ({err})") from None


def check_model_fits_data(model, dataset: PackedDataset) -> None:
    meta = dataset.metadata
    if model.config.max_position_embeddings < meta["S"]:
        raise RunError(
            f"the model has {model.config.max_position_embeddings} positions, the data has S={meta['S']}"
        )
    vocab = meta.get("vocab_size")
    if vocab is not None and vocab > model.config.vocab_size:
        raise RunError(
            f"the data's vocabulary ({vocab}) is larger than the model's ({model.config.vocab_size})"
        )


@dataclass(frozen=True)
class StepShape:
    """The batch arithmetic of a run, in packs and in (expected) sequences."""

    micro_batch_packs: int
    gradient_accumulation: int
    replicas: int
    packing_factor: float

    @property
    def packs_per_step(self) -> int:
        return self.micro_batch_packs * self.gradient_accumulation * self.replicas

    @property
    def sequences_per_step(self) -> float:
        return self.packs_per_step * self.packing_factor


def mlperf_eval_interval(global_batch_sequences: float) -> int:
    """MLPerf BERT: evaluate every floor(0.05 * (230.23 * GBS + 3e6) / 25000) * 25000 samples."""
    return max(25000, int(math.floor(0.05 * (230.23 * global_batch_sequences + 3e6) / 25000) * 25000))


def build_schedule(config: dict) -> WarmupPolyDecay:
    """Learning rate as a function of sequences trained (the same for every backend)."""
    o = config["optim"]
    return WarmupPolyDecay(
        peak_lr=o["lr"],
        warmup_samples=o["warmup_samples"],
        total_samples=o["total_samples"],
        power=o["poly_power"],
        end_lr=o["end_lr"],
        start_offset_samples=o["start_offset_samples"],
    )


def build_optimizer(model, config: dict, packing_factor: float, replicas: int):
    """The torch LAMB (betas and accumulation adjusted for packing), the adjustment and the
    step's batch arithmetic. The learning rate comes from build_schedule."""
    o = config["optim"]
    adjusted = adjust_for_packing(
        o["packing_adjustment"], packing_factor, o["gradient_accumulation"], tuple(o["betas"])
    )
    optimizer = Lamb(
        weight_decay_groups(model.named_parameters(), o["weight_decay"]),
        lr=0.0,
        betas=adjusted.betas,
        eps=o["eps"],
        weight_decay=o["weight_decay"],
        bias_correction=o["bias_correction"],
        max_grad_norm=o["max_grad_norm"],
    )
    shape = StepShape(
        config["data"]["micro_batch_packs"], adjusted.gradient_accumulation, replicas, packing_factor
    )
    return optimizer, adjusted, shape


def packing_factor(dataset: PackedDataset) -> float:
    return packing_factor_from_metadata(dataset.metadata)
