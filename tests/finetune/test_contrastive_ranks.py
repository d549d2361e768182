"""Contrastive training over torchrun's processes (issue 97): each process packs and embeds its
share of a step's pairs, and the anchors and candidates are gathered across processes (as
sentence-transformers' `gather_across_devices` does), so every anchor is scored against the
whole step's positives and negatives. Judged against one process: the same metrics at every
epoch and the same final weights, DDP and FSDP2, also where a step leaves a process no pair."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file

from packed_transformers.finetune import train as finetune
from packed_transformers.finetune.config import load_finetune_config

from ..family_helpers import SENTENCES, save_family_folder
from ..finetune_helpers import assert_same_run, torchrun

pytestmark = pytest.mark.slow  # torchrun processes


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """A tiny BERT (dropout off: ranks draw other random numbers) trained on 33 pairs a
    epoch in steps of 8: the last step's one pair leaves the second process none."""
    root = tmp_path_factory.mktemp("contrastive_ranks")
    folder = save_family_folder(root / "bert", "bert", "embedding")
    texts = [s for s in SENTENCES if 6 < len(s.split()) < 40]
    pairs = [{"anchor": " ".join(t.split()[:4]), "positive": t, "negative": texts[(i + 7) % len(texts)]}
             for i, t in enumerate(texts[:41])]  # fmt: skip
    (root / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[:33]))
    (root / "val.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[33:]))
    config = {
        "model": {"init_checkpoint": str(folder), "pooling": ["mean"], "hidden_dropout": 0.0,
                  "attention_dropout": 0.0},
        "data": {"task": "embedding", "train_file": str(root / "train.jsonl"),
                 "validation_file": str(root / "val.jsonl"), "max_sequence_length": 60},
        "batching": {"batch_size": 8},
        "optim": {"lr": 1e-3},
        "contrastive": {"symmetric": True},
        "training": {"epochs": 2, "progress": False},
    }  # fmt: skip
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def one_process(config_path):
    output = config_path.parent / "one"
    finetune.run_finetune(load_finetune_config(str(config_path), []), output)
    return output


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_two_processes_gather_the_step_and_train_what_one_trains(
    config_path, one_process, tmp_path, sharding
):
    done = torchrun(config_path, tmp_path / sharding, "--set", f"execution.sharding={sharding}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes share each step's rows" in done.stderr
    # every epoch's losses and validation scores within 1e-5; the weights: see below
    assert_same_run(one_process, tmp_path / sharding, epochs=2, atol=1.0, discrete={"train_accuracy": 1 / TRAIN_PAIRS},
                    strict=("train_loss", "validation_loss", "validation_ndcg@10", "validation_recall@1", "validation_recall@10"))  # fmt: skip
    start = load_file(str(config_path.parent / "bert" / "model.safetensors"))
    one = load_file(str(one_process / "model" / "model.safetensors"))
    ranks = load_file(str(tmp_path / sharding / "model" / "model.safetensors"))
    assert one.keys() == ranks.keys()
    # AdamW turns rounding-level differences of near-zero gradients (rarely seen tokens' rows)
    # into steps of lr's size, so the runs are held to 2% of how far training moved each tensor
    for name, weight in one.items():
        moved = float((weight - start[name]).abs().max())
        assert moved > 0 and float((ranks[name] - weight).abs().max()) <= 0.02 * moved + 1e-6, name


TRAIN_PAIRS = 33
