"""finetune.train's checkpoints: a stopped run resumes exactly, SIGINT/SIGTERM end in one line
with the work kept, a diverging or unsavable run ends in one line, and nothing is packed for
a length the model cannot take (reliability 5, items 3-5 and 7-8; the first hour's interrupts)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from packed_transformers.finetune import train as finetune
from packed_transformers.finetune.config import load_finetune_config

from ..conftest import REPO
from ..finetune_helpers import (
    StopAfter,  # noqa: F401
    write_config,  # noqa: F401 - the module's fixture
)


def weights(folder):
    return load_file(str(folder / "model" / "model.safetensors"))


@pytest.mark.parametrize("stop_after", [5, 19])  # inside epoch 0; inside epoch 1
def test_a_stopped_run_resumes_to_the_same_weights_and_metrics(tmp_path, checkpoint, stop_after):  # noqa: F811
    path = write_config(tmp_path, checkpoint, training={"epochs": 2, "progress": False},
                        model={"hidden_dropout": 0.1})  # fmt: skip
    config = load_finetune_config(str(path), [])
    straight = finetune.run_finetune(config, tmp_path / "straight")
    with pytest.raises(finetune.Interrupted, match="checkpoint kept at .*--resume"):
        finetune.run_finetune(config, tmp_path / "stopped", stop=StopAfter(stop_after))
    assert not (tmp_path / "stopped" / "model").exists()
    with pytest.raises(finetune.FinetuneError, match="holds an unfinished run"):
        finetune.run_finetune(config, tmp_path / "stopped")
    resumed = finetune.run_finetune(config, tmp_path / "stopped", resume=True)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [(tmp_path / run / "metrics.jsonl").read_text() for run in ("straight", "stopped")]
    assert lines[0] == lines[1] and len(lines[0].splitlines()) == 2
    assert resumed["train_steps"] == straight["train_steps"]
    assert resumed["validation_accuracy"] == straight["validation_accuracy"]


def test_resume_refuses_another_config_and_a_folder_without_checkpoint(tmp_path, checkpoint):  # noqa: F811
    config = load_finetune_config(str(write_config(tmp_path, checkpoint, training={"epochs": 2})), [])
    with pytest.raises(finetune.FinetuneError, match="holds no checkpoint"):
        finetune.run_finetune(config, tmp_path / "none", resume=True)
    with pytest.raises(finetune.Interrupted):
        finetune.run_finetune(config, tmp_path / "run", stop=StopAfter(3))
    config["optim"]["lr"] = 1e-4
    with pytest.raises(finetune.FinetuneError, match="differs from the checkpoint's in optim.lr"):
        finetune.run_finetune(config, tmp_path / "run", resume=True)


def test_a_checkpoint_of_the_earlier_layout_is_named_and_overwrite_clears_it(tmp_path, checkpoint):  # noqa: F811
    config = load_finetune_config(str(write_config(tmp_path, checkpoint, training={"epochs": 1})), [])
    old = tmp_path / "run" / "checkpoint"  # OUTPUT/checkpoint/ as fine-tuning wrote it before the one loop
    old.mkdir(parents=True)
    (old / "progress.json").write_text('{"epoch": 0}')
    with pytest.raises(finetune.FinetuneError, match="layout before the one training loop"):
        finetune.run_finetune(config, tmp_path / "run", resume=True)
    finetune.run_finetune(config, tmp_path / "run", overwrite=True)
    assert not old.exists() and (tmp_path / "run" / "model").is_dir()


def run_command(args, **options):
    return subprocess.run(
        [sys.executable, "-m", "packed_transformers.finetune.train", *args], cwd=REPO, capture_output=True, text=True,
        timeout=300, **options,
    )  # fmt: skip


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_sigterm_ends_in_one_line_and_resume_finishes(tmp_path, checkpoint):  # noqa: F811
    path = write_config(tmp_path, checkpoint, training={"epochs": 400, "progress": False})
    output = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "packed_transformers.finetune.train", "--config", str(path), "--output-dir", str(output)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((output / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped at epoch") and "--resume" in last and "Traceback" not in err
    from packed_transformers.finetune.checkpoint import read_progress

    assert read_progress(output).step > 0
    assert (output / "metrics.jsonl").read_text().strip()  # the finished epochs' lines are kept


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_a_length_beyond_the_models_positions_is_refused_before_packing(tmp_path, checkpoint):  # noqa: F811
    path = write_config(tmp_path, checkpoint)
    done = run_command(["--config", str(path), "--output-dir", str(tmp_path / "o"),
                        "--set", "data.max_sequence_length=100000"])  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: data.max_sequence_length 100000: the checkpoint {checkpoint} has 64 positions; give at most 64"
    )
    assert not (tmp_path / "o").exists()


def test_the_input_is_checked_before_the_model_is_opened(tmp_path, checkpoint, monkeypatch, capsys):  # noqa: F811
    """Issue 107: a pack_length shorter than the longest example (the batcher's check of the
    rows against the config) is refused before any model is opened, and --overwrite keeps the
    run it would have replaced."""
    from packed_transformers.door import opener
    from packed_transformers.finetune import jobs

    path = write_config(tmp_path, checkpoint, training={"epochs": 1})
    out = tmp_path / "o"
    assert finetune.main(["--config", str(path), "--output-dir", str(out)]) == 0
    kept = (out / "summary.json").read_bytes()

    def refuse_to_open(*args, **kwargs):
        raise AssertionError("a model was opened before the input was checked")

    monkeypatch.setattr(opener, "open_folder", refuse_to_open)
    monkeypatch.setattr(jobs, "open_folder", refuse_to_open)
    capsys.readouterr()
    argv = ["--config", str(path), "--output-dir", str(out), "--overwrite", "--set", "batching.mode=packed",
            "--set", "batching.pack_length=8"]  # fmt: skip
    assert finetune.main(argv) == 2
    assert "batching.pack_length 8 is shorter than the longest example" in capsys.readouterr().err
    assert (out / "summary.json").read_bytes() == kept


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_a_learning_rate_that_breaks_the_weights_stops_before_the_metrics(tmp_path, checkpoint):  # noqa: F811
    path = write_config(
        tmp_path, checkpoint, training={"epochs": 2, "progress": False}, batching={"batch_size": 200}
    )  # fmt: skip  (one step per epoch)
    done = run_command(["--config", str(path), "--output-dir", str(tmp_path / "o"), "--set", "optim.lr=1e30"])
    assert done.returncode == 3, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "diverged" in last and "Traceback" not in done.stderr and "ValueError" not in done.stderr
    assert not (tmp_path / "o" / "model").exists() and not (tmp_path / "o" / "checkpoints").exists()


def test_a_failed_final_save_is_one_line_and_keeps_the_checkpoint(tmp_path, checkpoint, monkeypatch):  # noqa: F811
    path = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})
    output = tmp_path / "o"
    config = load_finetune_config(str(path), [])
    original = finetune.Job

    def failing_save(model, folder):  # what the disk answers when it is full
        raise OSError(28, "No space left on device", str(folder / "model.safetensors"))

    from packed_transformers.finetune import jobs  # where the task's Job is built

    monkeypatch.setattr(jobs, "Job", lambda *fields: original(*fields[:5], failing_save, *fields[6:]))
    with pytest.raises(finetune.FinetuneError) as failed:
        finetune.run_finetune(config, output)
    monkeypatch.undo()
    message = str(failed.value)
    assert (
        "\n" not in message and "the final model could not be saved" in message and "No space left" in message
    )
    assert f"the checkpoint of epoch 0 is kept in {output / 'checkpoints'}" in message
    resumed = finetune.run_finetune(config, output, resume=True)  # space freed: --resume saves it
    assert (output / "model" / "model.safetensors").is_file() and resumed["train_steps"] > 0


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_a_file_size_limit_during_the_save_is_one_line(tmp_path, checkpoint):  # noqa: F811
    """The real failure: RLIMIT_FSIZE below the model's size (SIGXFSZ ignored, so the write
    fails with EFBIG instead of killing the process)."""
    path = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    done = run_command(["--config", str(path), "--output-dir", str(tmp_path / "o")], preexec_fn=limit)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and lines[-1].startswith("error: ")
    assert "File too large" in lines[-1] or "file-size limit" in lines[-1]


def test_saved_folders_get_the_users_umask_and_stale_temporaries_are_removed(tmp_path, checkpoint):  # noqa: F811
    from packed_transformers.common.files import atomic_folder

    path = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})
    output = tmp_path / "o"
    stale = tmp_path / "o" / ".model.tmp-999999999-abcd1234"  # what kill -9 during a save leaves
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = tmp_path / "o" / f".model.tmp-{os.getpid()}-live0000"  # a save in progress: kept
    fresh.mkdir()
    old_mask = os.umask(0o022)
    try:
        finetune.run_finetune(load_finetune_config(str(path), []), output)
    finally:
        os.umask(old_mask)
    model = output / "model"
    assert oct(model.stat().st_mode & 0o777) == oct(0o755)
    assert {oct(p.stat().st_mode & 0o777) for p in model.iterdir()} == {oct(0o644)}
    assert not stale.exists() and fresh.exists()
    with atomic_folder(tmp_path / "x") as tmp:
        (tmp / "f").write_text("x")
    assert oct((tmp_path / "x").stat().st_mode & 0o777) == oct(0o755)


def test_resume_takes_a_new_time_budget(tmp_path, checkpoint):  # noqa: F811
    """The time budget (and threads, the progress bar) may change on --resume: the one setting
    a user resumes to change; the weights still equal the uninterrupted run's."""
    config = load_finetune_config(str(write_config(tmp_path, checkpoint, training={"epochs": 2})), [])
    straight = finetune.run_finetune(config, tmp_path / "straight")
    with pytest.raises(finetune.Interrupted):
        finetune.run_finetune(config, tmp_path / "run", stop=StopAfter(3))
    config["training"]["max_seconds"] = 3600.0
    resumed = finetune.run_finetune(config, tmp_path / "run", resume=True)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["train_steps"] == straight["train_steps"]


def test_resume_removes_a_checkpoint_a_kill_left_half_written(tmp_path, checkpoint, caplog):  # noqa: F811
    """Issue 108 item 5: kill -9 during a checkpoint write left checkpoints/.step-N.tmp-PID-*
    (147 MB for MiniLM) for good: fine-tuning never called remove_leftovers, as BERT's and the
    decoder's runs do. A resume removes it, says so, and ends on the uninterrupted weights."""
    path = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})
    config = load_finetune_config(str(path), [])
    straight = finetune.run_finetune(config, tmp_path / "straight")
    with pytest.raises(finetune.Interrupted):
        finetune.run_finetune(config, tmp_path / "stopped", stop=StopAfter(3))
    half = tmp_path / "stopped" / "checkpoints" / ".step-00000002.tmp-999999999-abcd1234"
    (half / "model").mkdir(parents=True)
    (half / "model" / "model.safetensors").write_bytes(b"half-written")
    with caplog.at_level("WARNING", logger="finetune"):
        resumed = finetune.run_finetune(config, tmp_path / "stopped", resume=True)
    assert not half.exists()
    assert any("half-written" in r.getMessage() and str(half) in r.getMessage() for r in caplog.records)
    for name, tensor in weights(tmp_path / "straight").items():
        assert torch.equal(tensor, weights(tmp_path / "stopped")[name]), name
    assert resumed["validation_accuracy"] == straight["validation_accuracy"]


def test_resume_reads_its_checkpoint_once(tmp_path, checkpoint, monkeypatch):  # noqa: F811
    """Issue 107: the config is compared with the checkpoint's, and the run restored from it, on
    one reading: its files hashed once, its training state loaded once (it was twice each)."""
    from packed_transformers.components import checkpoint as ckpt

    config = load_finetune_config(
        str(write_config(tmp_path, checkpoint, training={"epochs": 2, "progress": False})), []
    )
    with pytest.raises(finetune.Interrupted):
        finetune.run_finetune(config, tmp_path / "run", stop=StopAfter(3))
    (kept,) = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    reads = []
    for name in ("check_checkpoint", "load_training_state"):
        real = getattr(ckpt, name)
        monkeypatch.setattr(
            ckpt, name, lambda path, real=real, name=name: reads.append((name, path)) or real(path)
        )
    resumed = finetune.run_finetune(config, tmp_path / "run", resume=True)
    assert sorted(name for name, path in reads if path == kept) == ["check_checkpoint", "load_training_state"]
    assert resumed["train_steps"] > 3


def test_overwrite_with_a_bad_input_line_keeps_the_run_it_would_replace(tmp_path, checkpoint, capsys):  # noqa: F811
    """--overwrite replaces a finished run only once the new run's input is read and checked: a bad
    line is one line and exit 2, and the old model and summary stay (the old run was removed first)."""
    path = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})
    out = tmp_path / "run"
    assert finetune.main(["--config", str(path), "--output-dir", str(out)]) == 0
    kept = {p.name: p.read_bytes() for p in [out / "summary.json", out / "model" / "model.safetensors"]}
    train_file = tmp_path / "train.jsonl"  # write_config's, 120 lines
    train_file.write_text(train_file.read_text() + "{not json\n")
    capsys.readouterr()
    assert finetune.main(["--config", str(path), "--output-dir", str(out), "--overwrite"]) == 2
    assert f"{train_file}:121" in capsys.readouterr().err.strip().splitlines()[-1]
    assert {
        p.name: p.read_bytes() for p in [out / "summary.json", out / "model" / "model.safetensors"]
    } == kept
