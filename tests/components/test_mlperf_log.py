"""MLPerf logs judged by MLCommons' own compliance checker (mlperf-logging, training
ruleset 5.0.0, closed BERT) on tiny runs, and the logged hyperparameters by hand."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from packed_transformers.components.mlperf_log import hyperparameters, mlperf_global_batch_size
from packed_transformers.components.step import BatchArithmetic

from ..training_helpers import metrics, run, write_config

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow

CHECK = [
    sys.executable,
    "-m",
    "mlperf_logging.compliance_checker",
    "--usage",
    "training",
    "--ruleset",
    "5.0.0",
]


def check(log_path) -> tuple[bool, list[str]]:
    """(passed, the checker's complaints)."""
    out = subprocess.run(
        [*CHECK, str(log_path)], capture_output=True, text=True, timeout=120, cwd=log_path.parent
    )
    text = out.stdout + out.stderr
    # Rule failures come as "WARNING - Failed checks for KEY : RULE" lines, missing or
    # misplaced keys as blocks between dashed lines; the verdict is SUCCESS or FAILED.
    warnings = [
        line for line in text.splitlines() if line.startswith(("WARNING", "ERROR")) and "FAILED" not in line
    ]
    blocks = [block.strip() for block in text.split("-" * 30)[1:-1] if block.strip()]
    return "SUCCESS" in text and "FAILED" not in text, warnings + blocks


def log_lines(path) -> list[dict]:
    return [
        json.loads(line.split(":::MLLOG ", 1)[1])
        for line in path.read_text().splitlines()
        if ":::MLLOG" in line
    ]


@pytest.fixture(scope="module")
def reached(packed, tmp_path_factory):
    """A tiny run that evaluates every 40 sequences and stops at a low target."""
    root = tmp_path_factory.mktemp("mlperf")
    config = write_config(
        root / "c.yaml",
        packed,
        training={"max_steps": 60},
        eval={"every_samples": 40, "target_mlm_accuracy": 0.0005, "max_sequences": 60},
        logging={
            "progress": False,
            "tensorboard": False,
            "mlperf": True,
            "submission_org": "packed-bert tests",
        },
    )
    done = run(config, root / "run")
    assert done.returncode == 0, done.stderr
    return root / "run"


def test_checker_passes_but_for_the_bert_target(reached, tmp_path):
    """The only complaint on a run that reached a low target is BERT's 0.720 bar; with that
    one accuracy value raised to 0.721 the checker passes."""
    log = reached / "mlperf.log"
    passed, complaints = check(log)
    assert not passed
    assert len(complaints) == 1 and "eval_accuracy" in complaints[0] and "0.720" in complaints[0], complaints
    edited = tmp_path / "mlperf.log"
    text = log.read_text()
    last = [m for m in re.finditer(r'"key": "eval_accuracy", "value": [0-9.e-]+', text)][-1]
    edited.write_text(text[: last.start()] + '"key": "eval_accuracy", "value": 0.721' + text[last.end() :])
    passed, complaints = check(edited)
    assert passed, complaints


def test_log_values_are_the_run_s(reached):
    lines = log_lines(reached / "mlperf.log")
    keys = [line["key"] for line in lines]
    for key in (
        "cache_clear",
        "init_start",
        "init_stop",
        "run_start",
        "run_stop",
        "block_start",
        "block_stop",
    ):
        assert key in keys, key
    assert keys.index("init_stop") < keys.index("run_start") < keys.index("block_start")
    value = {line["key"]: line["value"] for line in lines}
    assert isinstance(value["global_batch_size"], int)
    assert value["submission_org"] == "packed-bert tests" and value["submission_benchmark"] == "bert"
    evals = metrics(reached, "eval")
    accuracies = [line for line in lines if line["key"] == "eval_accuracy"]
    assert [a["metadata"]["epoch_num"] for a in accuracies] == [e["samples"] for e in evals]
    assert [a["value"] for a in accuracies] == [e["mlm_accuracy"] for e in evals]
    assert lines[-1]["key"] == "run_stop" and lines[-1]["metadata"]["status"] == "success"
    # blocks pair up, each closed before its evaluation
    starts = [i for i, k in enumerate(keys) if k == "block_start"]
    stops = [i for i, k in enumerate(keys) if k == "block_stop"]
    assert len(starts) == len(stops) and all(a < b for a, b in zip(starts, stops))


def test_run_stopped_early_still_writes_a_valid_log(packed, tmp_path):
    """Budget reached before the target: status aborted, every block closed, and the
    checker's only complaint is again the accuracy bar."""
    config = write_config(
        tmp_path / "c.yaml",
        packed,
        training={"max_steps": 4},
        eval={"every_samples": 10**9, "at_end": True, "max_sequences": 40},
    )
    done = run(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    lines = log_lines(tmp_path / "run" / "mlperf.log")
    assert lines[-1]["key"] == "run_stop" and lines[-1]["metadata"]["status"] == "aborted"
    passed, complaints = check(tmp_path / "run" / "mlperf.log")
    assert len(complaints) == 1 and "0.720" in complaints[0], complaints


def test_hyperparameters_are_logged_after_the_packing_adjustment():
    config = {
        "optim": {
            "lr": 0.00096,
            "eps": 1e-6,
            "weight_decay": 0.1,
            "warmup_samples": 0,
            "total_samples": 3680 * 768,
            "start_offset_samples": 0,
            "packing_adjustment": "same_packs_per_step",
            "gradient_accumulation": 4,
            "betas": [0.60466, 0.85437],
        },
        "training": {"seed": 1},
        "data": {"micro_batch_packs": 48, "max_sequence_length": 512},
    }
    batch = BatchArithmetic.from_config(config, packing_factor=2.0, replicas=2)
    assert mlperf_global_batch_size(batch) == 48 * 4 * 2 * 2  # packs x 2 (NVIDIA's convention)
    logged = hyperparameters(config, batch)
    assert logged["opt_lamb_beta_1"] == pytest.approx(0.60466**2)  # beta^p, as run
    assert logged["opt_lamb_beta_2"] == pytest.approx(0.85437**2)
    assert logged["gradient_accumulation_steps"] == 4
    assert logged["opt_learning_rate_training_steps"] == 3680
    unpacked = BatchArithmetic.from_config(
        {**config, "optim": {**config["optim"], "packing_adjustment": "none"}}, 1.0, 8
    )
    assert mlperf_global_batch_size(unpacked) == 48 * 4 * 8


def test_mlperf_lines_go_to_the_log_not_the_terminal(packed, tmp_path):
    """Issue 28: mlperf-logging echoes every line to stdout by default; a run's terminal
    shows progress and its own messages, the MLPerf lines only OUTPUT/mlperf.log."""
    config = write_config(
        tmp_path / "c.yaml",
        packed,
        training={"max_steps": 2},
        eval={"every_samples": 40, "max_sequences": 20},
        logging={"progress": False, "tensorboard": False, "mlperf": True},
    )
    done = run(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    assert ":::MLLOG" not in done.stdout + done.stderr
    assert any(line["key"] == "run_stop" for line in log_lines(tmp_path / "run" / "mlperf.log"))
