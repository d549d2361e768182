"""run_pretraining.py: config validation, loss goes down, exact resume, DDP equivalence, eval target."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from packed_transformers.training.config import ConfigError, load_config, validate

from ..conftest import REPO
from ..training_helpers import final_weights, metrics, run, write_config

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------
def test_config_errors_name_the_key(tmp_path):
    base = {"data": {"train_dir": "x"}}
    with pytest.raises(ConfigError, match=r"unknown key 'optim.learning_rate'.*did you mean 'optim.lr'"):
        validate({**base, "optim": {"learning_rate": 1e-3}})
    with pytest.raises(ConfigError, match=r"unknown section 'trainig'.*'training'"):
        validate({**base, "trainig": {}})
    with pytest.raises(ConfigError, match=r"training.max_steps: expected an integer"):
        validate({**base, "training": {"max_steps": "ten"}})
    with pytest.raises(ConfigError, match=r"optim.lr: must be >= 0"):
        validate({**base, "optim": {"lr": -1.0}})
    with pytest.raises(ConfigError, match=r"optim.betas"):
        validate({**base, "optim": {"betas": [0.9, 1.5]}})
    with pytest.raises(ConfigError, match=r"training.precision: 'fp8' is not one of"):
        validate({**base, "training": {"precision": "fp8"}})
    with pytest.raises(ConfigError, match=r"data.train_dir: give the packed training data"):
        validate({})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base))
    assert load_config(path, ["training.max_steps=7"])["training"]["max_steps"] == 7
    with pytest.raises(ConfigError, match=r"unknown key 'training.max_step'.*'training.max_steps'"):
        load_config(path, ["training.max_step=7"])


def test_every_shipped_config_validates():
    from packed_transformers.common.config_schema import read_yaml
    from packed_transformers.finetune.config import load_finetune_config
    from packed_transformers.training.decoder.config import (
        division_fault,
        is_decoder_config,
        load_decoder_config,
    )

    decoders = 0
    for path in sorted((REPO / "configs").glob("*.yaml")):
        # Fine-tuning configs have their own schema (finetune.config); a decoder pretraining
        # config (its model section names a family) training/decoder's, as run_pretraining.py chooses.
        if path.name.startswith("finetune_"):
            load_finetune_config(path)
        elif is_decoder_config(read_yaml(path)):
            config = load_decoder_config(read_yaml(path), [], str(path))
            decoders += 1
            # each decoder config's division is one its rows' layout allows (pack-documents'
            # OUTPUT/<layout>/train), and its name says which
            layout = Path(config["data"]["train_dir"]).parent.name
            division = config["logging"]["submission_division"]
            assert division_fault(division, layout) is None, path.name
            assert (division == "closed") == path.stem.endswith("_closed"), path.name
        else:
            load_config(path)
    assert decoders == 4
    assert division_fault("closed", "documents") and division_fault("open", "concatenated") is None


def test_short_cpu_run_lowers_the_loss_and_logs(packed, tmp_path):
    config = write_config(
        tmp_path / "c.yaml", packed, optim={"lr": 0.05}, training={"max_steps": 20, "log_every_steps": 1}
    )
    done = run(config, tmp_path / "run")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = metrics(tmp_path / "run")
    assert rows[-1]["step"] == 20
    assert np.mean([r["loss"] for r in rows[-3:]]) < np.mean([r["loss"] for r in rows[:3]]) - 0.5
    assert all(r["sequences_per_second"] > 0 and r["tokens_per_second"] > 0 for r in rows)
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "mlperf.log").is_file()
    # samples are real sequences, never packs
    assert rows[-1]["samples"] == sum(r["sequences"] for r in rows)


def test_bad_inputs_fail_before_compute(packed, tmp_path):
    cases = {
        "missing data dir": ({"data": {"train_dir": str(tmp_path / "nope")}}, "does not exist"),
        "S differs": ({"data": {"max_sequence_length": 128}}, "S=64 in metadata.json"),
        "K differs": ({"data": {"max_sequences_per_pack": 2}}, "K=3 in metadata.json"),
        "checkpoint does not fit": ({"model": {"init_checkpoint": str(tmp_path / "ckpt")}}, "does not fit"),
    }
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"hidden_size": 384, "num_hidden_layers": 6}))
    for name, (sections, words) in cases.items():
        config = write_config(tmp_path / f"{name}.yaml", packed, **sections)
        done = run(config, tmp_path / f"out-{name}")
        assert done.returncode == 2 and words in done.stderr, (name, done.stderr)
    # a data folder whose metadata is from another format version
    bad = tmp_path / "old"
    bad.mkdir()
    (bad / "metadata.json").write_text(json.dumps({"format": "packed-bert", "format_version": 0}))
    done = run(write_config(tmp_path / "old.yaml", packed, data={"train_dir": str(bad)}), tmp_path / "o1")
    assert done.returncode == 2 and "version" in done.stderr
    # an output folder holding another run
    config = write_config(tmp_path / "ok.yaml", packed, training={"max_steps": 1})
    assert run(config, tmp_path / "taken").returncode == 0
    done = run(config, tmp_path / "taken")
    assert done.returncode == 2 and "--resume" in done.stderr
    # a starting checkpoint whose weights hold a NaN: the door's check, before any step
    from safetensors.torch import save_file

    start = tmp_path / "nan_start"
    shutil.copytree(sorted((tmp_path / "taken" / "checkpoints").glob("step-*"))[-1] / "model", start)
    weights = load_file(start / "model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, start / "model.safetensors", metadata={"format": "pt"})
    done = run(
        write_config(tmp_path / "nan.yaml", packed, model={"init_checkpoint": str(start)}), tmp_path / "o2"
    )
    assert done.returncode == 2 and f"weight {name} holds" in done.stderr.strip().splitlines()[-1], (
        done.stderr[-800:]
    )


def test_resume_after_budget_stop_is_bitwise_identical(packed, tmp_path):
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 6})
    assert run(config, tmp_path / "straight").returncode == 0
    first = run(config, tmp_path / "split", "--set", "training.max_steps=3")
    assert first.returncode == 0, first.stderr
    second = run(config, tmp_path / "split", "--resume")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr and "step-00000003 (step 3, " in second.stderr  # what it took up
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    steps = [r["step"] for r in metrics(tmp_path / "split")]
    assert steps == [1, 2, 3, 4, 5, 6], "no step repeated or skipped"
    straight = [r["loss"] for r in metrics(tmp_path / "straight")]
    split = [r["loss"] for r in metrics(tmp_path / "split")]
    assert straight == split


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_interrupted_run_resumes_to_the_same_weights(packed, tmp_path, how):
    sections = dict(
        training={"max_steps": 40, "checkpoint_every_steps": 2},
        data={"loader_workers": 1, "micro_batch_packs": 4},
    )
    config = write_config(tmp_path / "c.yaml", packed, **sections)
    assert run(config, tmp_path / "straight").returncode == 0
    proc = run(config, tmp_path / "cut", wait=False)
    checkpoints = tmp_path / "cut" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and len(list(checkpoints.glob("step-*"))) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == (143 if how == "sigterm" else -9), out
    stopped_at = max(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*"))
    assert stopped_at < 40, "the run must have been interrupted before its end"
    done = run(config, tmp_path / "cut", "--resume")
    assert done.returncode == 0, done.stderr
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "cut")
    assert max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-6


def test_corrupt_checkpoint_is_refused_and_the_previous_one_used(packed, tmp_path):
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "straight").returncode == 0
    assert run(config, tmp_path / "r", "--set", "training.max_steps=4").returncode == 0
    newest = sorted((tmp_path / "r" / "checkpoints").glob("step-*"))[-1]
    state = newest / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated by a full disk, say
    done = run(config, tmp_path / "r", "--resume", "--set", "training.max_steps=4")
    assert done.returncode == 0
    assert "does not match its sha256" in done.stderr and "step-00000002" not in str(newest)


def test_two_replicas_equal_one_with_the_same_global_batch(packed, tmp_path):
    no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    one = write_config(
        tmp_path / "one.yaml",
        packed,
        model=no_dropout,
        optim={"gradient_accumulation": 2},
        training={"max_steps": 4},
    )
    two = write_config(
        tmp_path / "two.yaml",
        packed,
        model=no_dropout,
        optim={"gradient_accumulation": 1},
        training={"max_steps": 4},
    )
    assert run(one, tmp_path / "one").returncode == 0
    done = run(two, tmp_path / "two", torchrun=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    a, b = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-5
    ma, mb = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["masked_tokens"] for r in ma] == [r["masked_tokens"] for r in mb]  # exact sums
    assert [r["sequences"] for r in ma] == [r["sequences"] for r in mb]
    np.testing.assert_allclose([r["loss"] for r in ma], [r["loss"] for r in mb], rtol=1e-5)


def test_eval_stops_at_target_and_logs_success(packed, tmp_path):
    config = write_config(
        tmp_path / "c.yaml",
        packed,
        training={"max_steps": 50},
        eval={"every_samples": 20, "target_mlm_accuracy": 0.0, "max_sequences": 60},
    )
    done = run(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    evals = metrics(tmp_path / "run", "eval")
    assert len(evals) == 1 and evals[0]["sequences"] <= 60
    end = metrics(tmp_path / "run", "end")[0]
    assert end["status"] == "success" and end["step"] < 50
    log = (tmp_path / "run" / "mlperf.log").read_text()
    assert '"key": "eval_accuracy"' in log and '"status": "success"' in log
