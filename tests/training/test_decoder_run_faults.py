"""Decoder pretraining under faults: keys the data or machine cannot hold refused before the run
folder, a killed save's temporary removed at resume, a checkpoint that cannot be written ends
the run in one line, a BERT folder as the start named as such."""

from __future__ import annotations

import json

import pytest

from ..training_helpers import decoder_rows, pretrain_decoder


# ----- the run ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_root(tmp_path_factory, decoder_train_rows):
    root = decoder_train_rows.parent
    decoder_rows(root / "eval", lengths=(8, 20, 31, 4) * 3, seed=1)
    return root


def pretrain(root, output, *sets, resume=False):
    return pretrain_decoder(root, output, *sets, resume=resume)


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("data.micro_batch_rows=100000", "100000 rows a step: data.train_dir holds"),
        ("model.vocab_size=10", "model.vocab_size 10: below the rows' vocabulary of 50 tokens"),
        ("model.vocab_size=99999999", "parameters (vocab_size 99999999) need"),
    ],
)
def test_a_key_the_data_or_the_machine_cannot_hold_is_refused_before_the_run_folder(
    data_root, tmp_path, setting, expected
):
    done = pretrain(data_root, tmp_path / "run", setting)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert expected in lines[-1] and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_temporary_left_by_a_killed_save_is_removed_at_resume(data_root, tmp_path):
    first = pretrain(data_root, tmp_path / "run", "training.checkpoint_every_steps=1")
    assert first.returncode == 0, first.stderr[-2000:]
    leftover = tmp_path / "run/checkpoints/.step-00000003.tmp-99999-abcd"
    leftover.mkdir()
    (leftover / "training_state.pt").write_bytes(b"half")
    again = pretrain(data_root, tmp_path / "run", "training.checkpoint_every_steps=1", "training.max_steps=3",
                     resume=True)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert not leftover.exists()
    names = sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir())
    assert all(not n.startswith(".") for n in names), names


def test_a_metrics_file_that_cannot_be_read_at_resume_is_one_line(data_root, tmp_path):
    """As BERT's run (components.run_checkpoint.forget_lines_after): a damaged metrics.jsonl
    refuses the resume in one line naming it (it was a traceback, exit 1), the file untouched."""
    first = pretrain(data_root, tmp_path / "run", "training.checkpoint_every_steps=1", "training.max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    metrics = tmp_path / "run/metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b"\x00\xff not a record\n")
    damaged = metrics.read_bytes()
    again = pretrain(data_root, tmp_path / "run", "training.max_steps=3", resume=True)
    last = again.stderr.strip().splitlines()[-1]
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert last.startswith("error: --resume: ") and "metrics.jsonl" in last, last
    assert metrics.read_bytes() == damaged


def test_resume_follows_the_one_policy_of_every_pretraining_run(data_root, tmp_path):
    """components.checkpoint.resume_from, as BERT's run: weights that match the manifest but do
    not load are a damaged checkpoint (reported, the previous one resumed, the same end as an
    uninterrupted run); --resume with nothing to resume from is refused in one line (the decoder
    run started over from step 0 then, and loaded weights with strict=False)."""
    import torch

    from ..training_helpers import damage_newest_weights, final_weights

    sets = ("training.checkpoint_every_steps=1", "training.max_steps=3")
    straight = pretrain(data_root, tmp_path / "straight", *sets)
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = pretrain(data_root, tmp_path / "run", "training.checkpoint_every_steps=1", "training.max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    damage_newest_weights(tmp_path / "run")
    again = pretrain(data_root, tmp_path / "run", *sets, resume=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "its weights cannot be loaded" in again.stderr and "resumed from" in again.stderr
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)
    nothing = pretrain(data_root, tmp_path / "empty", *sets, resume=True)
    assert (
        nothing.returncode == 2
        and "holds no intact checkpoint to resume from" in nothing.stderr.strip().splitlines()[-1]
    )


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line(tmp_path):
    """A full disk at the checkpoint (RLIMIT_FSIZE below its size, SIGXFSZ ignored: the write
    fails as on a full disk): one line naming the checkpoint, exit 2, no half-written folder
    (it was the project's own CheckpointError as a 27-line traceback, exit 1)."""
    import resource
    import signal
    import subprocess
    import sys

    from ..conftest import REPO
    from ..training_helpers import DECODER_S

    decoder_rows(tmp_path / "train")
    decoder_rows(tmp_path / "eval", seed=1)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (20_000, 20_000)
        )  # the weights fit, the optimizer's state not

    sets = [f"data.train_dir={tmp_path / 'train'}", f"data.eval_dir={tmp_path / 'eval'}",
            f"data.max_sequence_length={DECODER_S}", "eval.rows=2", "model.hidden_size=16",
            "model.intermediate_size=32", "model.num_hidden_layers=1", "training.max_steps=2"]  # fmt: skip
    output = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "run_pretraining.py", "--config", "configs/pretrain_decoder_tiny.yaml", "--output-dir",
         str(output), *[a for s in sets for a in ("--set", s)]],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=small_files,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and f"{output}/checkpoints/step-00000002: writing the checkpoint failed" in errors[0]
    )
    assert list((output / "checkpoints").iterdir()) == []  # nothing half-written


def test_a_bert_folder_as_the_starting_checkpoint_is_named_as_such(tmp_path):
    """It was `cannot be loaded (...: the model's head is not in the file (..., cls.predictions.
    transform.LayerNorm.bi)`, cut mid-word; now the folder's model_type is named, before any
    run folder is written."""
    from packed_transformers.data.assets import model_dir

    root = tmp_path / "rows"
    decoder_rows(root / "train")
    decoder_rows(root / "eval", seed=1)
    done = pretrain_decoder(root, tmp_path / "out", f"model.init_checkpoint={model_dir()}")
    assert done.returncode == 2
    assert (
        f"model.init_checkpoint {model_dir()}: its config.json says model_type 'bert', not a decoder family"
        in done.stderr
    )
    assert not (tmp_path / "out").exists()


def test_a_diverging_run_stops_at_its_first_nonfinite_step_and_keeps_the_good_checkpoints(
    data_root, tmp_path
):
    """The one divergence rule (components.loop, components.step): a learning rate that blows the
    weights up stops the run at the first step whose loss or gradient norm is not finite, exit 3,
    one line, the checkpoint of the step before it the newest; the end record says so."""
    import json

    done = pretrain(data_root, tmp_path / "run", "optim.lr=1e30", "optim.warmup_samples=0",
                    "training.max_steps=4", "training.checkpoint_every_steps=1")  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: diverged: step ") and "no checkpoint written for it" in last, last
    assert "Traceback" not in done.stderr
    bad = int(last.split("step ")[1].split(":")[0])
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert kept and kept[-1] == f"step-{bad - 1:08d}", (kept, bad)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "end" and records[-1]["stopped_by"] == "diverged"


def test_resuming_a_finished_run_adds_nothing(data_root, tmp_path):
    """Reliability 9, item 3: --resume of a decoder run that had finished ran its final
    evaluation again and appended a second eval and end record (13 lines instead of 11)."""
    first = pretrain(data_root, tmp_path / "run", "training.max_steps=3")
    assert first.returncode == 0, first.stderr[-2000:]
    records = (tmp_path / "run/metrics.jsonl").read_text()

    def mlperf_keys() -> list[str]:
        log = (tmp_path / "run/mlperf.log").read_text().splitlines()
        return [json.loads(line.split(":::MLLOG ", 1)[1])["key"] for line in log if ":::MLLOG " in line]

    evaluations = mlperf_keys().count("eval_accuracy")
    again = pretrain(data_root, tmp_path / "run", "training.max_steps=3", resume=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "run/metrics.jsonl").read_text() == records
    assert "the run was complete at step 3" in again.stderr
    # the resumed process evaluates nothing; its MLPerf block ends as every block does
    assert mlperf_keys().count("eval_accuracy") == evaluations and mlperf_keys()[-1] == "run_stop"
