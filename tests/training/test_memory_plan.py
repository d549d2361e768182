"""The memory plan (`run_pretraining.py --plan`, training/decoder/memory_plan.py, issue 81): its
bytes against the peak memory of the run's own steps at a small shape (within 10%), its
arithmetic per rank, and the command as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from packed_transformers.training.decoder.config import validate
from packed_transformers.training.decoder.memory_plan import (
    USABLE_FRACTION,
    plan_memory,
    rank_memory,
    rows_vocabulary,
)

from ..conftest import REPO

VOCAB, S = 32000, 1024
SHAPE = {"family": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": VOCAB}  # fmt: skip


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory):
    """Rows of S tokens, one document each (document-masked packs of the concatenated layout's shape)."""
    from packed_transformers.packs.lm_rows.layouts import document_rows
    from packed_transformers.packs.lm_rows.store import write_rows

    folder = tmp_path_factory.mktemp("long_rows") / "train"
    rng = np.random.default_rng(0)
    documents = [rng.integers(1, VOCAB, S).astype(np.int32) for _ in range(8)]
    write_rows(folder, document_rows(documents, S, depth=None), VOCAB, 0, {"role": "train"})
    return folder


def small_config(rows, **sections) -> dict:
    raw = {"model": dict(SHAPE), "data": {"train_dir": str(rows), "max_sequence_length": S},
           "optim": {"gradient_accumulation": 1}, "execution": {"threads": 2},
           "logging": {"submission_division": "open"}}  # fmt: skip
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def measured_peak(raw: dict, tmp_path) -> int:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    # cold (a fresh interpreter, not the warm launcher's fork): a forked child starts with its
    # parent's resident pages and peak
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(REPO), PACKED_TESTS_COLD="1")
    done = subprocess.run([sys.executable, str(REPO / "tests/training/memory_probe.py"), tmp_path / "config.json",
                           tmp_path / "run"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sections",
    # one micro-batch alone is the accumulating case's first half: its figure is in the docs
    [{"execution": {"activation_checkpointing": True}}, {"optim": {"gradient_accumulation": 2}}],
    ids=["activation-checkpointing", "accumulating"],
)
def test_the_plan_is_within_10_percent_of_the_runs_measured_peak(long_rows, tmp_path, sections):
    raw = small_config(long_rows, **sections)
    config = validate(raw)
    checkpointed = config["execution"]["activation_checkpointing"]
    planned = plan_memory(config, VOCAB).per_rank(1, False, checkpointed).total
    measured = measured_peak(raw, tmp_path)
    assert abs(planned - measured) <= 0.10 * measured, (planned / 2**20, measured / 2**20)


def test_sharding_divides_the_model_and_its_state_and_keeps_the_activations(long_rows):
    config = validate(small_config(long_rows, training={"precision": "bf16"}))
    plan = plan_memory(config, VOCAB)
    alone, two, eight = (
        plan.per_rank(1, False, False),
        plan.per_rank(2, True, False),
        plan.per_rank(8, True, False),
    )
    parameters = plan.parameters
    assert alone.weights == 4 * parameters and alone.optimizer == 8 * parameters
    assert two.weights == 4 * -(-parameters // 2) and eight.optimizer == 8 * -(-parameters // 8)
    assert two.activations == eight.activations > 0  # a micro-batch per rank, whatever the count
    # bf16: FSDP2 computes with bf16 parameters, so a rank holds no fp32 casts of them
    assert two.activations < alone.activations
    assert eight.total < two.total < alone.total
    # activation checkpointing keeps less of the step
    assert plan.per_rank(2, True, True).activations < two.activations
    # what the plan needs: the fewest GPUs whose usable memory holds the per-rank total
    gpu = int(two.total / USABLE_FRACTION) + 1
    needed, sharded = plan.needed(gpu, checkpointed=False)
    assert sharded and needed <= 2 and plan.per_rank(needed, True, False).total <= USABLE_FRACTION * gpu
    assert plan.needed(alone.total * 10, checkpointed=False) == (1, False)
    # the sum is the rows
    assert two.total == two.weights + two.gradients + two.optimizer + two.gathered + two.activations
    assert rank_memory(plan.steps[True, False], 2, True, True) == two


def test_plan_command_prints_the_table_and_refuses_in_one_line(long_rows, tmp_path):
    from ..training_helpers import run_here

    config = REPO / "configs" / "pretrain_decoder_tiny.yaml"
    output = tmp_path / "run"
    sets = ["--set", f"data.train_dir={long_rows}", "--set", f"data.max_sequence_length={S}"]
    done = run_here(config, output, "--plan", "--gpus", "4", "--gpu-memory-gib", "2", *sets)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fsdp, 4 ranks" in done.stdout and "needs (as configured): 1 GPU of 2 GiB" in done.stdout
    # the vocabulary is the rows' (metadata.json: 32,000) where the config leaves it null
    from packed_transformers.common.config_schema import read_yaml
    from packed_transformers.training.decoder.config import load_decoder_config

    tiny = load_decoder_config(
        read_yaml(config), [f"data.train_dir={long_rows}", f"data.max_sequence_length={S}"], "c"
    )
    assert tiny["model"]["vocab_size"] is None
    assert f"llama, {plan_memory(tiny, VOCAB).parameters:,} parameters" in done.stdout
    assert not output.exists()  # nothing written
    # a BERT config, a plan with no vocabulary and a bad GPU count are refused in one line
    bert = run_here(REPO / "configs/demo.yaml", output, "--plan")
    assert (
        bert.returncode == 2
        and "the memory plan is for decoder configs" in bert.stderr.strip().splitlines()[-1]
    )
    nothing = run_here(config, output, "--plan", "--set", f"data.train_dir={tmp_path / 'none'}")
    assert (
        nothing.returncode == 2 and "--plan needs the vocabulary" in nothing.stderr.strip().splitlines()[-1]
    )
    zero = run_here(config, output, "--plan", "--gpus", "0", *sets)
    assert zero.returncode == 2 and "--gpus must be between 1 and 1,000,000, got 0" in zero.stderr
    assert not output.exists()


@pytest.mark.parametrize(
    "arguments, said",
    [
        (["--gpu-memory-gib", "inf"], "--gpu-memory-gib must be a size above 0 and at most 1,000,000, got inf"),
        (["--gpu-memory-gib", "nan"], "got nan"),
        (["--gpus", "100000000000000000000"], "--gpus must be between 1 and 1,000,000"),
        (["--set", "model.num_hidden_layers=1000000"], "model.num_hidden_layers: must be <= 1024"),
        (["--set", "model.hidden_size=10000000"], "model.hidden_size: must be <= 65536"),
        (["--set", "data.max_sequence_length=1000000000"], "data.max_sequence_length: must be <= 1048576"),
    ],
)  # fmt: skip
def test_the_plan_refuses_sizes_no_machine_has_in_one_line(arguments, said, tmp_path):
    """Reliability 9, items 7 and 8: an infinite GPU ran the whole plan and died in an
    OverflowError; a million layers grew past 900 MB for minutes before any line."""
    from ..training_helpers import run_here

    done = run_here(REPO / "configs" / "pretrain_decoder_tiny.yaml", tmp_path / "run", "--plan", *arguments)
    assert done.returncode == 2, done.stderr[-2000:]
    assert said in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_8b_config_states_the_gpus_its_plan_needs():
    """configs/pretrain_decoder_llama31_8b_closed.yaml says how many 80-GiB GPUs it needs; its plan
    (Llama 3.1 8B at 8,192 tokens, on fake tensors: about 15 s here) says the same."""
    import re

    from packed_transformers.common.config_schema import read_yaml
    from packed_transformers.training.decoder.config import load_decoder_config

    path = REPO / "configs" / "pretrain_decoder_llama31_8b_closed.yaml"
    stated = re.search(r"^# needs: (\d+) GPUs of (\d+) GiB", path.read_text(), re.MULTILINE)
    config = load_decoder_config(read_yaml(path), [], str(path))
    # the Open config (document-masked packs) is the same model and step: it states the same
    open_path = path.with_name("pretrain_decoder_llama31_8b_open.yaml")
    open_config = load_decoder_config(read_yaml(open_path), [], str(open_path))
    assert stated[0] in open_path.read_text()
    for section in ("model", "optim", "training", "execution"):
        assert open_config[section] == config[section], section
    assert {open_config["data"]["max_sequence_length"], open_config["data"]["micro_batch_rows"]} == {
        config["data"]["max_sequence_length"],
        config["data"]["micro_batch_rows"],
    }
    assert config["execution"]["sharding"] == "fsdp" and config["execution"]["activation_checkpointing"]
    plan = plan_memory(config, rows_vocabulary(config), checkpointing=(True,))  # as the config runs
    assert plan.parameters == 8_030_261_248  # Llama 3.1 8B
    gpu_bytes = int(stated[2]) * 2**30
    assert plan.needed(gpu_bytes, checkpointed=True) == (int(stated[1]), True)
    # without sharding no GPU of that size holds it
    assert plan.per_rank(1, False, True).total > gpu_bytes
    assert (False, False) not in plan.steps  # only what was asked for was planned
