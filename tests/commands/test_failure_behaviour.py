"""Failure behaviour found by a hostile run (issue 22), one test per fixed defect."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from packed_transformers.common.files import sha256_file

from ..conftest import REPO
from ..training_helpers import metrics, run, write_config

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow


class _Payload:
    """Unpickling this runs `touch MARKER` (what a received checkpoint could do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resume_never_unpickles_code_from_a_checkpoint(packed, tmp_path):
    """D2: a checkpoint whose training_state.pt holds a pickled payload, with a manifest
    that matches it, is refused on --resume (exit 2, one line) and its code never runs."""
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    state_file = checkpoint / "training_state.pt"
    state = torch.load(state_file, weights_only=True)
    marker = tmp_path / "payload-ran"
    state["evil"] = _Payload(marker)
    torch.save(state, state_file)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["training_state.pt"] = {
        "bytes": state_file.stat().st_size,
        "sha256": sha256_file(state_file),
    }
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))

    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=4")
    assert done.returncode == 2, done.stdout + done.stderr
    assert not marker.exists(), "the checkpoint's pickled code ran"
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "training_state.pt" in error[0] and "refused" in error[0]


def test_resume_state_round_trips_through_weights_only_loading(packed, tmp_path):
    """The RNG states (numpy's too) survive weights_only loading: a resumed run equals the
    uninterrupted one step for step."""
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4})
    assert run(config, tmp_path / "straight").returncode == 0
    assert run(config, tmp_path / "split", "--set", "training.max_steps=2").returncode == 0
    assert run(config, tmp_path / "split", "--resume").returncode == 0
    straight = [r["loss"] for r in metrics(tmp_path / "straight")]
    split = [r["loss"] for r in metrics(tmp_path / "split")]
    assert straight == split


def test_numbers_parse_as_users_write_them(tmp_path):
    """D9: `--set optim.lr=1e-3` (the README's own example) and `lr: 2e-3` in a YAML file,
    which YAML 1.1 reads as strings, are numbers; words and non-finite values are refused."""
    from packed_transformers.training.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {train_dir: x}\noptim: {lr: 2e-3, eps: 1E-6}\n")
    config = load_config(path)
    assert config["optim"]["lr"] == 0.002 and config["optim"]["eps"] == 1e-6
    assert load_config(path, ["optim.lr=1e-3"])["optim"]["lr"] == 0.001
    assert load_config(path, ["optim.betas=[9e-1, 0.999]"])["optim"]["betas"] == [0.9, 0.999]
    for bad in ("optim.lr=fast", "optim.lr=nan", "optim.lr=1e999"):
        with pytest.raises(ConfigError, match="optim.lr"):
            load_config(path, [bad])


def _strict_json(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_diverging_run_stops_at_the_first_non_finite_step(packed, tmp_path):
    """D1: lr 1e6 diverges; the run stops at the first non-finite step with one line
    naming it, exit 3, never writes a checkpoint with non-finite weights, and
    metrics.jsonl stays valid JSON."""
    from safetensors.torch import load_file

    config = write_config(
        tmp_path / "c.yaml",
        packed,
        optim={"lr": 1e6},
        training={"max_steps": 30, "checkpoint_every_steps": 1},
    )
    done = run(config, tmp_path / "run")
    assert done.returncode == 3, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"step \d+: non-finite", errors[0]), errors
    for checkpoint in (tmp_path / "run" / "checkpoints").glob("step-*"):
        weights = load_file(checkpoint / "model" / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), checkpoint.name
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [_strict_json(line) for line in lines]
    assert records[-1]["kind"] == "end" and records[-1]["status"] == "aborted"


def test_skip_policy_skips_then_gives_up(packed, tmp_path):
    """D1: training.on_nonfinite skip drops non-finite steps (weights untouched) and
    stops once more than max_skipped_steps were skipped."""
    config = write_config(
        tmp_path / "c.yaml",
        packed,
        optim={"lr": 1e6},
        training={"max_steps": 30, "on_nonfinite": "skip", "max_skipped_steps": 2},
    )
    done = run(config, tmp_path / "run")
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stderr.count("step skipped") == 2
    assert "more than 2 skipped steps" in done.stderr


def _copy_packed(packed, tmp_path):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(packed, copy)
    return copy


def _edit_metadata(folder, change):
    meta_path = folder / "train" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    change(meta)
    meta_path.write_text(json.dumps(meta))


def _verify(folder):
    import subprocess
    import sys

    from ..conftest import REPO

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "packed_transformers.packing",
            "verify",
            "--input",
            str(folder / "raw-train" / "part-00000.h5"),
            "--packed",
            str(folder / "train"),
            "--quiet",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bit_flipped_or_truncated_shard_is_refused_before_the_run(packed, tmp_path):
    """D3: a shard whose bytes changed (same size) or that was truncated is refused
    before any compute, with the shard named; no run folder is set up."""
    data = _copy_packed(packed, tmp_path)
    shard = data / "train" / "part-00000.h5"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    config = write_config(tmp_path / "c.yaml", data, training={"max_steps": 2})
    done = run(config, tmp_path / "run")
    assert done.returncode == 2 and "part-00000.h5" in done.stderr and "sha256" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
    shard.write_bytes(bytes(raw[: len(raw) // 2]))
    done = run(config, tmp_path / "run")
    assert done.returncode == 2 and "truncated" in done.stderr, done.stderr


def test_edited_metadata_counts_are_refused_by_verify_and_training(packed, tmp_path):
    """D4: counts in metadata.json that the shards do not add up to are refused."""
    for field in ("packs", "sequences", "packing_factor"):
        data = _copy_packed(packed, tmp_path / field)

        def change(meta, field=field):
            meta[field] = meta[field] * 2

        _edit_metadata(data, change)
        checked = _verify(data)
        assert checked.returncode == 2 and field in checked.stderr and '"ok": true' not in checked.stdout, (
            checked
        )
        config = write_config(tmp_path / field / "c.yaml", data, training={"max_steps": 2})
        done = run(config, tmp_path / field / "run")
        assert done.returncode == 2 and field in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["../part-00000.h5", "/etc/passwd", "sub/part-00000.h5", ".."])
def test_shard_names_must_be_plain_names_inside_the_folder(packed, tmp_path, name):
    """D5: metadata.json cannot point verify or training outside the packed folder."""
    data = _copy_packed(packed, tmp_path)

    def change(meta):
        meta["shards"][0]["name"] = name

    _edit_metadata(data, change)
    checked = _verify(data)
    assert checked.returncode == 2 and "plain file name" in checked.stderr, checked
    config = write_config(tmp_path / "c.yaml", data, training={"max_steps": 2})
    done = run(config, tmp_path / "run")
    assert done.returncode == 2 and "plain file name" in done.stderr, done.stderr


def test_final_step_is_checkpointed_once_and_replacement_keeps_a_folder(packed, tmp_path, monkeypatch):
    """D6: the last step's checkpoint is written once; replacing a folder renames the new
    one in before the old one is removed, and a crash between leaves the old one."""
    from packed_transformers.common import files

    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4, "checkpoint_every_steps": 2})
    done = run(config, tmp_path / "run")
    assert done.returncode == 0
    assert done.stderr.count("checkpoint ") == 2 and done.stderr.count("step-00000004") == 1, done.stderr

    target = tmp_path / "ckpt" / "step-00000001"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("old")
    real_replace = os.replace
    calls = []

    def crash_on_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_folder(target) as tmp:
            (tmp / "new.txt").write_text("new")
    monkeypatch.undo()
    from packed_transformers.components.checkpoint import remove_leftovers

    remove_leftovers(target.parent)  # what a resume does first
    assert (target / "old.txt").read_text() == "old"


def test_resume_with_nothing_to_resume_refuses(packed, tmp_path):
    """D7: every checkpoint corrupt -> --resume exits 2 and overwrites nothing."""
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0
    for state in (tmp_path / "run" / "checkpoints").glob("step-*/training_state.pt"):
        state.write_bytes(b"garbage")
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    done = run(config, tmp_path / "run", "--resume", "--set", "training.max_steps=4")
    assert done.returncode == 2 and "no intact checkpoint" in done.stderr, done.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_resume_does_not_repeat_metric_lines_and_removes_half_written_checkpoints(packed, tmp_path):
    """D14 and D15: after a crash past the newest checkpoint, the resumed run's
    metrics.jsonl holds every step once; a temporary checkpoint folder is removed."""
    import shutil

    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 4, "checkpoint_every_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000004")  # steps 3-4 were logged, never checkpointed
    leftover = checkpoints / ".step-00000004.k2j3"
    leftover.mkdir()
    done = run(config, tmp_path / "run", "--resume")
    assert done.returncode == 0, done.stderr
    assert not leftover.exists()
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4]


def test_integer_labels_name_their_own_class():
    """D10: with 11 or more integer classes, class i is named "i" (not sorted as text)."""
    from packed_transformers.data.classification_data import Examples, encode_labels, label_names_of

    labels = list(range(12)) + [2, 10]
    examples = Examples(
        texts=["t"] * len(labels),
        pairs=[None] * len(labels),
        labels=labels,
        where=[f"f:{i}" for i in range(len(labels))],
    )
    names = label_names_of(examples)
    assert names == [str(i) for i in range(12)]
    encoded = encode_labels(examples, names, multi_label=False)
    assert [names[c] for c in encoded] == [str(label) for label in labels]


def test_one_run_per_output_folder(packed, tmp_path):
    """D8: while a run trains in a folder, a second run (or --resume) on it exits 2; a pack
    into a folder another process is packing into is refused the same way."""
    import subprocess
    import sys
    import time

    config = write_config(
        tmp_path / "c.yaml",
        packed,
        training={"max_steps": 100000, "max_seconds": 120},
        data={"loader_workers": 0},
    )
    first = run(config, tmp_path / "run", wait=False)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").is_file():
            time.sleep(0.1)
        second = run(config, tmp_path / "run", "--resume")
        assert second.returncode == 2 and "in use by another run" in second.stderr, second.stderr
    finally:
        first.kill()
        first.communicate()

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from packed_transformers.common.files import lock_folder; lock_folder({str(tmp_path / 'p')!r}, 'pack');"
            "import time; print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        from packed_transformers.packing.pipeline import PackJob, run_pack
        from packed_transformers.packs.errors import PackingInputError

        job = PackJob(
            inputs=(str(packed / "raw-train" / "part-00000.h5"),),
            output=str(tmp_path / "p"),
            algorithm="lpfhp",
            max_sequences_per_pack=3,
            max_sequence_length=64,
            max_predictions_per_seq=10,
            seed=1,
            shard_size=100,
            vocab_size=1200,
        )
        with pytest.raises(PackingInputError, match="in use by another pack"):
            run_pack(job, quiet=True)
    finally:
        holder.kill()
        holder.communicate()


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"data": {"micro_batch_packs": 100000}}, "data.micro_batch_packs"),
        ({"model": {"vocab_size": 100}}, "vocabulary"),
    ],
)
def test_refused_run_leaves_nothing_that_refuses_its_rerun(packed, tmp_path, bad, key):
    """D11: checks that fail after the output folder was set up used to leave config.yaml
    behind, so the corrected command was refused with and without --resume."""
    config = write_config(tmp_path / "bad.yaml", packed, training={"max_steps": 1}, **bad)
    done = run(config, tmp_path / "run")
    assert done.returncode == 2 and key in done.stderr, done.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()
    fixed = write_config(tmp_path / "good.yaml", packed, training={"max_steps": 1})
    again = run(fixed, tmp_path / "run")
    assert again.returncode == 0, again.stderr


def test_environment_errors_are_one_line_exit_2(packed, tmp_path):
    """D13: an output folder under a file, and a file-size limit hit while packing, end in
    one `error:` line naming the path and the reason, exit 2, no traceback."""
    import resource
    import signal
    import subprocess
    import sys

    (tmp_path / "afile").write_text("x")
    config = write_config(tmp_path / "c.yaml", packed, training={"max_steps": 1})
    done = run(config, tmp_path / "afile" / "run")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")][0].count("afile") >= 1

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    packed_raw = packed / "raw-train" / "part-00000.h5"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "packed_transformers.packing",
            "pack",
            "--input",
            str(packed_raw),
            "--output",
            str(tmp_path / "p"),
            "--max-sequence-length",
            "64",
            "--max-predictions-per-seq",
            "10",
            "--vocab-size",
            "1200",
            "--quiet",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_files,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert ("File too large" in out.stderr or "file-size limit" in out.stderr) and str(
        tmp_path / "p"
    ) in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "p" / "metadata.json").exists()


def test_bad_received_files_are_one_line_errors(tmp_path):
    """D13: non-UTF-8 JSON lines name the line; a garbage finetune.json or weights file is
    refused in one line."""
    from packed_transformers.data.classification_data import ExampleError, read_jsonl
    from packed_transformers.door.folder import load_finetuned
    from packed_transformers.door.folder_spec import FINETUNE_INFO

    bad = tmp_path / "x.jsonl"
    bad.write_bytes(b'{"text": "fine", "label": "a"}\n{"text": "caf\xe9", "label": "a"}\n')
    with pytest.raises(ExampleError, match=r"x.jsonl:2: not UTF-8"):
        read_jsonl(bad, "text", None, "label")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / FINETUNE_INFO).write_text("{not json")
    with pytest.raises(ExampleError, match=FINETUNE_INFO):
        load_finetuned(folder)


def test_messages_name_what_is_wrong(packed, tmp_path):
    """D16: the misleading messages, each now naming the real cause."""
    from packed_transformers.common.config_schema import ConfigError
    from packed_transformers.data.tokenizer import DataInputError, load_tokenizer
    from packed_transformers.training.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {train_dir: x}\noptim: {learnig_rate: 0.1}\n")
    with pytest.raises(ConfigError, match=r"did you mean 'optim.lr'"):
        load_config(path)
    with pytest.raises(DataInputError) as caught:
        load_tokenizer(tmp_path / "missing-vocab.txt")
    assert "--vocab" not in str(caught.value) and "missing-vocab.txt" in str(caught.value)

    data = _copy_packed(packed, tmp_path)

    def s_as_text(meta):
        meta["S"] = str(meta["S"])

    _edit_metadata(data, s_as_text)
    done = run(write_config(tmp_path / "s.yaml", data, training={"max_steps": 1}), tmp_path / "s-run")
    assert done.returncode == 2 and "field 'S' must be an integer" in done.stderr, done.stderr

    config = write_config(tmp_path / "r.yaml", packed, training={"max_steps": 2})
    assert run(config, tmp_path / "run").returncode == 0
    changed = run(config, tmp_path / "run", "--resume", "--set", "optim.lr=0.02")
    assert changed.returncode == 2 and "optim.lr is 0.02" in changed.stderr, changed.stderr
    workers = run(
        config,
        tmp_path / "run",
        "--resume",
        "--set",
        "data.loader_workers=1",
        "--set",
        "training.max_steps=3",
    )
    assert workers.returncode == 0, workers.stderr


def test_verify_reports_a_shard_record_without_sha256(packed, tmp_path):
    """D13: a shard record without sha256 is a verify failure (exit 1, named), not a traceback."""
    data = _copy_packed(packed, tmp_path)

    def drop(meta):
        del meta["shards"][0]["sha256"]

    _edit_metadata(data, drop)
    checked = _verify(data)
    assert checked.returncode == 1 and "Traceback" not in checked.stderr, checked
    assert "part-00000.h5: sha256 differs from (or is missing in)" in checked.stdout + checked.stderr


def test_sigterm_during_export_exits_143_in_one_line_and_leaves_nothing(tmp_path):
    """Issue 108 item 5: SIGTERM during `packed export` ended the process by the signal's default
    action (exit -15, no word) and left the temporary folder (87 MB for MiniLM) for good."""
    import signal
    import subprocess
    import sys
    import time

    from packed_transformers.data.assets import model_dir

    process = subprocess.Popen(
        [sys.executable, "-m", "packed_transformers.commands.export", "--model", str(model_dir()),
         "--output", str(tmp_path / "exported")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".exported.tmp-*")):  # the export is writing its folder
        assert process.poll() is None, f"the export ended first: {process.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped; nothing was written"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert list(tmp_path.iterdir()) == []
