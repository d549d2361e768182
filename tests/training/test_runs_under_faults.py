"""Pretraining runs under faults: resume refuses other data or a damaged checkpoint and skips one
that does not load; a full disk during a checkpoint leaves none half-written; cut-off metrics,
skipped steps and the summary of a run's end stay right."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ..conftest import REPO
from ..training_helpers import make_packed, metrics, run, write_config


@pytest.mark.slow
def test_a_cut_off_last_metrics_line_is_dropped_on_resume_and_in_summary(tmp_path):
    """#5 and #13: a disk that filled mid-line left half a JSON record; --resume and
    training.summary read the complete lines and go on."""
    from packed_transformers.training import summary

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0
    path = tmp_path / "run" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # no newline: cut off
    assert summary.main(["--packed", str(tmp_path / "run")]) == 0
    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=6")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    for line in path.read_text().splitlines():
        json.loads(line)


def test_summary_of_a_foreign_or_broken_folder_is_one_line(tmp_path, capsys):
    """#13: a missing folder, a binary metrics.jsonl: exit 2, one line."""
    from packed_transformers.training import summary

    assert summary.main(["--packed", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("data: {train_dir: " + str(tmp_path) + "}\n")
    (tmp_path / "metadata.json").write_text('{"packing_factor": 1.0}')
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b"\x00\xff\xfe binary\n")
    assert summary.main(["--packed", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err


@pytest.mark.slow
def test_resume_refuses_other_data_at_the_same_path_and_reads_the_checkpoints_config(tmp_path):
    """#1: re-packed with K 3 -> 2 at the same path, --resume went on (exit 0) with another
    packing factor; #14: with config.yaml deleted, any change was accepted. Both exit 2 now."""
    import shutil

    from packed_transformers.packing.pipeline import PackJob, run_pack

    from ..training_helpers import VOCAB, P, S

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0

    shutil.copy(tmp_path / "run" / "config.yaml", tmp_path / "kept.yaml")
    (tmp_path / "run" / "config.yaml").unlink()
    other = write_config(tmp_path / "o.yaml", packed, training={"max_steps": 4}, optim={"lr": 0.5})
    done = run(other, tmp_path / "run", "--resume")
    assert done.returncode == 2 and "optim.lr" in done.stderr and "the checkpoint" in done.stderr
    shutil.copy(tmp_path / "kept.yaml", tmp_path / "run" / "config.yaml")

    for name in ("train", "eval"):  # re-packed in place with K = 2
        shutil.rmtree(packed / name)
        job = PackJob(inputs=(str(packed / f"raw-{name}" / "part-00000.h5"),), output=str(packed / name),
                      algorithm="lpfhp", max_sequences_per_pack=2, max_sequence_length=S,
                      max_predictions_per_seq=P, seed=1, shard_size=100, vocab_size=VOCAB)  # fmt: skip
        run_pack(job, quiet=True)
    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=4")
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "metadata.json" in error[0] and "changed" in error[0]


@pytest.mark.slow
def test_eval_data_for_a_bigger_vocabulary_is_refused_at_start_naming_the_settings(tmp_path):
    """#4: the eval set was not checked against the model (a traceback at the first
    evaluation, hours in); the message now names model.vocab_size and packing's --vocab-size."""
    import shutil

    from packed_transformers.packing.pipeline import PackJob, run_pack

    from ..training_helpers import VOCAB, P, S

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    shutil.rmtree(packed / "eval")
    job = PackJob(inputs=(str(packed / "raw-eval" / "part-00000.h5"),), output=str(packed / "eval"),
                  algorithm="lpfhp", max_sequences_per_pack=3, max_sequence_length=S,
                  max_predictions_per_seq=P, seed=1, shard_size=100, vocab_size=VOCAB * 4)  # fmt: skip
    run_pack(job, quiet=True)
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2})
    done = run(config, tmp_path / "run")
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "data.eval_dir" in error[0] and "model.vocab_size" in error[0]
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.slow
def test_skipped_steps_are_logged_as_skipped_and_their_budget_survives_resume(tmp_path):
    """#12: a window of skipped steps was logged as loss 0.0 (reads as perfect), broke
    training.summary (ZeroDivisionError), and --resume reset the skip budget; the pipeline
    engine accepted `skip` and never applied it."""
    from packed_transformers.training import summary

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    nan = {"optim": {"lr": 1e6}}  # every step's loss and gradients overflow
    # lr 1e6: steps 1-2 finite, every later one non-finite (skipped, weights untouched)
    config = write_config(tmp_path / "c.yaml", packed, **nan, training={
        "max_steps": 4, "on_nonfinite": "skip", "max_skipped_steps": 3})  # fmt: skip
    done = run(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    rows = metrics(tmp_path / "run")
    skipped = [r for r in rows if r.get("skipped_steps")]
    assert [r["step"] for r in skipped] == [3, 4] and all(r["loss"] is None for r in skipped)
    assert summary.main(["--packed", str(tmp_path / "run")]) == 0
    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=6")
    assert done.returncode == 3, done.stderr  # steps 3, 4 before; 5 is the 3rd of 3, 6 the 4th
    assert "more than 3 skipped steps" in done.stderr
    pipeline = write_config(tmp_path / "p.yaml", packed, training={"on_nonfinite": "skip"},
                            execution={"device": "cpu", "threads": 1, "layers_per_stage": [1, 1]})  # fmt: skip
    done = run(pipeline, tmp_path / "pipe")
    assert done.returncode == 2 and "training.on_nonfinite skip" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("limit", [500_000, 1_000_000])
def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_half_checkpoint(tmp_path, limit):
    """#5: safetensors' SafetensorError (model.safetensors is 751 kB here: limit 500 kB)
    and torch.save's "unexpected pos" (training_state.pt is 1.5 MB: limit 1 MB) are not
    OSError: they were a traceback, exit 1, no path. A real file-size limit."""
    import resource
    import signal
    import subprocess
    import sys

    from ..conftest import REPO

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    (tmp_path / "data").mkdir()
    packed = make_packed(tmp_path / "data")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2})
    done = subprocess.run(
        [sys.executable, "run_pretraining.py", "--config", str(config), "--output-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=small_files,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "step-00000002" in error[0] and "writing the checkpoint failed" in error[0]
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []  # no half-written folder


def test_summary_reports_the_runs_end_not_its_last_logging_window(tmp_path, capsys):
    """#13: a 19-step, 60 s run stopped by a time limit between windows was reported as
    10 steps / 36 s (its last logged window)."""
    import yaml

    from packed_transformers.training import summary

    data = tmp_path / "data"
    data.mkdir()
    (data / "metadata.json").write_text(json.dumps({"packing_factor": 1.5}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"data": {"train_dir": str(data), "eval_dir": None, "max_sequence_length": 64},
              "model": {"preset": "bert-tiny"}, "eval": {"max_sequences": 10}}  # fmt: skip
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    window = {
        "kind": "train",
        "loss": 7.0,
        "sequences": 75,
        "sequences_per_second": 4.2,
        "tokens_per_second": 90.0,
    }
    lines = [
        {**window, "step": 5, "samples": 75, "train_seconds": 18.0},
        {**window, "step": 10, "samples": 150, "train_seconds": 36.0},
        {
            "kind": "end",
            "step": 19,
            "samples": 290,
            "status": "aborted",
            "seconds": 61.0,
            "train_seconds": 60.0,
        },
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert summary.main(["--packed", str(run_dir)]) == 0
    assert (
        "| 1.500 | 19 | aborted | 290 | 60 |" in capsys.readouterr().out
    )  # an end record from before stopped_by
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    assert summary.main(["--packed", str(run_dir)]) == 0  # killed before its end record
    assert "| 1.500 | 10 | - | 150 | 36 |" in capsys.readouterr().out


# ----- 14. finetune.train --resume on a damaged checkpoint, or on changed data ---------------------
@pytest.mark.slow  # a stopped fine-tuning run per case
@pytest.mark.parametrize(
    "damage", ["model/model.safetensors", "training_state.pt", "manifest.json", "train data"]
)
def test_resume_refuses_a_damaged_checkpoint_or_changed_data_in_one_line(tmp_path, damage):
    from packed_transformers.data.assets import model_dir
    from packed_transformers.finetune import train as finetune
    from packed_transformers.finetune.config import load_finetune_config

    from ..finetune_helpers import StopAfter, write_config

    config = load_finetune_config(str(write_config(tmp_path, model_dir(), training={"epochs": 2})), [])
    with pytest.raises(finetune.Interrupted):
        finetune.run_finetune(config, tmp_path / "run", stop=StopAfter(3))
    if damage == "train data":  # other rows at the same path
        train = tmp_path / "train.jsonl"
        lines = train.read_text().splitlines()
        train.write_text("\n".join(reversed(lines)) + "\n")
        expected = "the training or validation data changed since the checkpoint"
    else:
        (newest,) = (tmp_path / "run" / "checkpoints").glob("step-*")
        path = newest / damage
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])  # cut in half
        expected = "holds no intact checkpoint"  # the one resume policy: none left to take
    with pytest.raises(finetune.FinetuneError) as refused:
        finetune.run_finetune(config, tmp_path / "run", resume=True)
    assert expected in str(refused.value) and "--overwrite" in str(refused.value), str(refused.value)


# ----- 10. pretraining --resume on a checkpoint whose manifest matches damaged weights --------------
def test_resume_skips_a_checkpoint_whose_weights_match_the_manifest_but_do_not_load(packed, tmp_path):
    from ..training_helpers import damage_newest_weights, final_weights, run, write_config

    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "straight").returncode == 0
    assert run(config, tmp_path / "r").returncode == 0
    damage_newest_weights(tmp_path / "r")
    done = run(config, tmp_path / "r", "--resume")
    assert done.returncode == 0, done.stderr
    assert "its weights cannot be loaded" in done.stderr and "Traceback" not in done.stderr
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "r")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the previous checkpoint, trained on to the same end


@pytest.mark.slow
def test_a_time_budget_bar_counts_to_the_budget_not_to_max_steps(tmp_path):
    """Pretraining stopped by a 3 s training budget with max_steps 100,000: the bar shows the
    nearest limit's percentage (the old bar counted 14/100000 with a 28-hour ETA)."""
    from ..training_helpers import make_packed, run_here, write_config

    packed = make_packed(tmp_path)
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 100_000, "max_train_seconds": 3},
                          logging={"progress": True, "tensorboard": False, "mlperf": False})  # fmt: skip
    done = run_here(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr[-2000:]
    bars = [line for line in done.stderr.replace("\r", "\n").splitlines() if "of max_train_seconds" in line]
    assert bars and "100000" not in bars[-1] and "%" in bars[-1], done.stderr[-1500:]
    assert "100/100" in bars[-1] or "100.0/100" in bars[-1]


@pytest.mark.slow
def test_the_mlperf_config_names_every_missing_prerequisite_at_once(tmp_path):
    """Run from an empty folder: no data, no phase-1 checkpoint, no GPU, one line for all three."""
    import shutil

    config = tmp_path / "mlperf_nvidia_8gpu_gbs768.yaml"
    shutil.copyfile(REPO / "configs" / "mlperf_nvidia_8gpu_gbs768.yaml", config)
    done = subprocess.run([sys.executable, str(REPO / "run_pretraining.py"), "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-1000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    line = errors[0]
    assert "data.train_dir mlperf_data/packed_512" in line and "data.eval_dir" in line
    assert "model.init_checkpoint checkpoints/phase1_hf" in line and "See docs/mlperf.md." in line
    import torch

    if not torch.cuda.is_available():
        assert "execution.device cuda" in line and "CPU build" in line
    assert not (tmp_path / "runs").exists()
