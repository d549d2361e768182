"""data.synthetic: random packs made in memory for throughput checks. Well-formed packed
batches at the asked packing factor, the same pack for the same index, a run on the torch
engine that reads no file, and the config checks around it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packed_transformers.components.batch_check import validate_batch
from packed_transformers.components.synthetic import SyntheticPacks, mlm_slots
from packed_transformers.training.config import ConfigError, validate
from packed_transformers.training.run import run_training

from ..training_helpers import VOCAB, base_config


def test_synthetic_packs_are_well_formed_full_and_at_the_packing_factor():
    packs = SyntheticPacks(s=128, k=3, packing_factor=2.4, vocab_size=VOCAB, seed=7)
    batch = packs[list(range(400))]
    validate_batch(batch, VOCAB, 128)
    assert batch["input_ids"].shape == (400, 128) and batch["masked_lm_ids"].shape == (400, mlm_slots(128, 3))
    assert (batch["sequence_ids"] > 0).all()  # every token used: the cost of full packs
    per_pack = batch["next_sentence_weights"].sum(1).double()
    assert per_pack.min() >= 2 and per_pack.max() <= 3
    assert per_pack.mean().item() == pytest.approx(2.4, abs=0.08)
    masked = (batch["masked_lm_weights"] > 0).sum(1).double() / 128
    assert masked.mean().item() == pytest.approx(0.15, abs=0.01)
    again = packs[[5, 3]]
    for name in batch:
        assert np.array_equal(again[name][0], batch[name][5]) and np.array_equal(
            again[name][1], batch[name][3]
        )
    assert packs.metadata["packing_factor"] == 2.4 and packs.sequences == round(len(packs) * 2.4)


def test_a_synthetic_run_trains_without_data_files(tmp_path):
    config = base_config(tmp_path)  # tmp_path holds no data at all
    config["data"].update(
        synthetic=True, eval_dir=None, max_sequences_per_pack=3, synthetic_packing_factor=2.0
    )
    config["training"]["max_steps"] = 3
    config["logging"]["mlperf"] = False
    assert run_training(validate(config), tmp_path / "out") == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 3 and all(np.isfinite(r["loss"]) for r in train)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"data": {"eval_dir": "x"}}, r"data.eval_dir: evaluation measures nothing on synthetic data"),
        ({"logging": {"mlperf": True}}, r"logging.mlperf: a synthetic-data run must not write an MLPerf log"),
        ({"data": {"max_sequences_per_pack": None}}, r"data.max_sequences_per_pack: synthetic packs need K"),
        ({"data": {"synthetic_packing_factor": 3.5}}, r"synthetic_packing_factor 3.5 is more than"),
        ({"execution": {"compile_only": True}}, r"execution.compile_only: only PopTorch compiles"),
    ],
)
def test_synthetic_and_compile_only_config_errors_name_the_key(tmp_path, changes, message):
    config = base_config(tmp_path)
    config["data"].update(synthetic=True, eval_dir=None, max_sequences_per_pack=3)
    config["logging"]["mlperf"] = False
    for section, values in changes.items():
        config[section].update(values)
    with pytest.raises(ConfigError, match=message):
        validate(config)
