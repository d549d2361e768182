"""The torch pipeline backend on CPU (gloo): the same numbers as one process, whole-model
checkpoints across stage counts, and clear errors for bad splits."""

from __future__ import annotations

import pytest

from ..training_helpers import final_weights, metrics, run, write_config

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow

NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def _config(path, packed, split=None, schedule="1f1b", ga=2, steps=4):
    execution = {"device": "cpu", "threads": 1, "layers_per_stage": split, "pipeline_schedule": schedule}
    return write_config(
        path,
        packed,
        model=NO_DROPOUT,
        optim={"gradient_accumulation": ga},
        training={"max_steps": steps, "checkpoint_every_steps": 2},
        execution=execution,
    )


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.fixture(scope="module")
def single(packed, tmp_path_factory):
    """One process, GA 2 and GA 4: the references."""
    root = tmp_path_factory.mktemp("single")
    for ga in (2, 4):
        done = run(_config(root / f"ga{ga}.yaml", packed, ga=ga), root / f"ga{ga}")
        assert done.returncode == 0, done.stderr[-2000:]
    return root


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_match_one_process(packed, single, tmp_path, schedule):
    config = _config(tmp_path / "c.yaml", packed, split=[1, 1], schedule=schedule)
    done = run(config, tmp_path / "pp", torchrun=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _max_diff(final_weights(single / "ga2"), final_weights(tmp_path / "pp")) <= 1e-5
    ours, reference = metrics(tmp_path / "pp"), metrics(single / "ga2")
    assert [r["masked_tokens"] for r in ours] == [r["masked_tokens"] for r in reference]
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in reference], abs=1e-5)


def test_two_stages_times_two_replicas_match_one_process(packed, single, tmp_path):
    """4 processes: 2 pipelines of 2 stages, GA 2 each = one process with GA 4."""
    config = _config(tmp_path / "c.yaml", packed, split=[1, 1], schedule="gpipe", ga=2)
    done = run(config, tmp_path / "pp", torchrun=4)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _max_diff(final_weights(single / "ga4"), final_weights(tmp_path / "pp")) <= 1e-5
    ours, reference = metrics(tmp_path / "pp"), metrics(single / "ga4")
    assert [r["sequences"] for r in ours] == [r["sequences"] for r in reference]


def test_checkpoints_resume_across_stage_counts(packed, single, tmp_path):
    """Saved with 2 stages, resumed with 1 process; saved with 1, resumed with 2 stages:
    both end where the uninterrupted single-process run ends."""
    two = _config(tmp_path / "two.yaml", packed, split=[1, 1], steps=2)
    assert run(two, tmp_path / "a", torchrun=2).returncode == 0
    done = run(
        two,
        tmp_path / "a",
        "--resume",
        "--set",
        "training.max_steps=4",
        "--set",
        "execution.layers_per_stage=null",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _max_diff(final_weights(single / "ga2"), final_weights(tmp_path / "a")) <= 1e-5

    one = _config(tmp_path / "one.yaml", packed, steps=2)
    assert run(one, tmp_path / "b").returncode == 0
    done = run(
        one,
        tmp_path / "b",
        "--resume",
        "--set",
        "training.max_steps=4",
        "--set",
        "execution.layers_per_stage=[1, 1]",
        torchrun=2,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _max_diff(final_weights(single / "ga2"), final_weights(tmp_path / "b")) <= 1e-5


@pytest.mark.parametrize(
    "split, message",
    [
        ([2, 1], r"sums to 3, but the model has 2 encoder layers"),
        ([2, 0], r"a stage without layers"),
        ([1, 1], r"needs one process per stage: start with torchrun --nproc-per-node 2"),
    ],
)
def test_bad_splits_exit_2_with_the_reason(packed, tmp_path, split, message):
    import re

    done = run(_config(tmp_path / "c.yaml", packed, split=split), tmp_path / "out")
    assert done.returncode == 2
    assert re.search(message, done.stderr), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_pipelined_evaluation_equals_one_process(packed, tmp_path):
    """Eval through the schedule (forward only, last micro-batches padded with empty packs)
    gives the single process's exact counts and accuracy."""
    outputs = {}
    for name, split, procs in (("one", None, 0), ("pp", [1, 1], 2)):
        config = _config(tmp_path / f"{name}.yaml", packed, split=split, steps=2)
        text = config.read_text().replace("at_end: false", "at_end: true")
        config.write_text(text)
        done = run(config, tmp_path / name, torchrun=procs)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs[name] = metrics(tmp_path / name, "eval")[-1]
    one, pp = outputs["one"], outputs["pp"]
    assert (pp["masked_tokens"], pp["sequences"]) == (one["masked_tokens"], one["sequences"])
    assert pp["mlm_accuracy"] == pytest.approx(one["mlm_accuracy"], abs=1e-6)
    assert pp["loss"] == pytest.approx(one["loss"], abs=1e-5)
