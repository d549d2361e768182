"""Outputs never harm what they point at: devices, FIFOs, folders, symlinks, inputs, hub caches, a
second run on the same output, links at the temporary name; refused in one line, left as they are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from packed_transformers.common.files import (
    FolderInUse,
    atomic_folder,
    atomic_path,
    lock_folder,
    output_file,
    output_over_inputs,
)

from ..conftest import REPO
from ..folder_helpers import embed_argv, input_file, one_line_error, run_module, tiny_hub_classifier  # noqa: F401


# ----- 1. outputs go only to a regular file or a new path -------------------------------------
def test_a_fifo_device_or_directory_is_refused_and_left_as_it_is(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, kind in [(fifo, "a FIFO"), ("/dev/null", "a character device"), (tmp_path, "a directory")]:
        assert kind in output_over_inputs(path)
        with pytest.raises(OSError, match="regular file|a directory"), atomic_path(path) as tmp:
            tmp.write_text("x")
    assert fifo.is_fifo() and os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]  # no temporary file left


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "real.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    assert output_file(link) == target.resolve()
    with atomic_path(link) as tmp:
        tmp.write_text("new")
    assert link.is_symlink() and target.read_text() == "new"
    to_device = tmp_path / "null"
    to_device.symlink_to("/dev/null")
    with pytest.raises(OSError, match="character device"), atomic_path(to_device) as tmp:
        tmp.write_text("x")
    assert to_device.is_symlink()


def test_a_folder_output_over_a_file_or_device_is_refused(tmp_path):
    plain = tmp_path / "file"
    plain.write_text("keep")
    for path in (plain, "/dev/null"):
        with pytest.raises(OSError, match="not a folder"), atomic_folder(path):
            pass
    assert plain.read_text() == "keep" and not os.path.isfile("/dev/null")


@pytest.mark.slow  # a whole command in a fresh interpreter
@pytest.mark.parametrize(
    "command",
    [
        ["-m", "packed_transformers.data.train_vocab", "--input", "{text}", "--output", "{out}"],
        [
            "-m",
            "packed_transformers.finetune.embed",
            "--model",
            "{folder}",
            "--input",
            "{text}",
            "--output",
            "{out}",
        ],
        [
            "-m",
            "packed_transformers.finetune.predict",
            "--model",
            "{folder}",
            "--input",
            "{text}",
            "--output",
            "{out}",
        ],
    ],
)
def test_commands_refuse_a_device_or_fifo_output_in_one_line(tmp_path, command):
    text = tmp_path / "in.txt"
    text.write_text('{"text": "some words here"}\n')  # JSON lines for embed and predict, text for train_vocab
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for out in (fifo, "/dev/null"):
        argv = [a.format(text=text, out=out, folder=tmp_path) for a in command]
        done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "regular file" in lines[0], done.stderr
    assert fifo.is_fifo()


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_an_output_of_dash_is_refused_not_written_as_a_file_named_dash(command, hub_classifier, tmp_path,
                                                                      monkeypatch, capsys):  # fmt: skip
    """Issue 108 item 8: `--output -` (a shell's standard output) wrote a file named `-`."""
    import importlib

    main = importlib.import_module(f"packed_transformers.commands.{command}").main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"text": "some words here"}\n')
    assert main(["--model", str(hub_classifier), "--input", "in.jsonl", "--output", "-"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "standard output" in err, err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    assert "standard output" in output_over_inputs("-") and output_over_inputs("./-") is None


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_an_existing_output_is_replaced_only_with_overwrite_by_every_command(command, hub_classifier, tmp_path,
                                                                              capsys):  # fmt: skip
    """Issue 108 item 8: predict replaced an existing output silently where embed refused it."""
    import importlib

    main = importlib.import_module(f"packed_transformers.commands.{command}").main
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "some words here"}\n')
    out = tmp_path / ("out.jsonl" if command == "predict" else "out.npy")
    argv = ["--model", str(hub_classifier), "--input", str(source), "--output", str(out)]
    argv += ["--pooling", "cls"] if command == "embed" else []  # the classifier's encoder, pooled
    assert main(argv) == 0
    first = out.read_bytes()
    out.write_bytes(b"the user's own file")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --overwrite" in err and str(out) in err, err
    assert out.read_bytes() == b"the user's own file"
    assert main([*argv, "--overwrite"]) == 0
    assert out.read_bytes() == first


def test_an_output_never_resolves_to_an_input_or_into_a_folder_read(tmp_path):
    """#3: the shared check, symlinks followed."""
    source = tmp_path / "corpus.txt"
    source.write_text("x")
    (tmp_path / "link.txt").symlink_to(source)
    model = tmp_path / "model"
    model.mkdir()
    assert "also an input" in output_over_inputs(tmp_path / "link.txt", [source])
    assert "inside" in output_over_inputs(model / "vocab.txt", [], [model])
    assert output_over_inputs(tmp_path / "out.txt", [source], [model]) is None
    assert "is a directory" in output_over_inputs(tmp_path, [source])


def test_the_folder_lock_follows_symlinks(tmp_path):
    """#6: runs/A -> runs/B and runs/B take the same lock."""
    import subprocess
    import sys

    real = tmp_path / "B"
    real.mkdir()
    (tmp_path / "A").symlink_to(real)
    code = "import sys, time; from packed_transformers.common.files import lock_folder; lock_folder(sys.argv[1], 'run'); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "A")], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse):
            lock_folder(real, "run")
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow  # two real processes
def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(hub_classifier, tmp_path):
    source = input_file(tmp_path / "in.jsonl", ["one text", "another text"])
    output = tmp_path / "e.npy"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from packed_transformers.common.files import lock_folder; "
         f"lock_folder({str(output)!r}, 'finetune.embed writing this output'); print('held', flush=True); time.sleep(60)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        done = run_module("packed_transformers.finetune.embed", *embed_argv(hub_classifier, source, output))
        assert "in use by another finetune.embed" in one_line_error(done)
        assert not output.exists() and not (tmp_path / ".e.npy.partial").exists()
    finally:
        holder.kill()
        holder.wait()
    done = run_module("packed_transformers.finetune.embed", *embed_argv(hub_classifier, source, output))
    assert done.returncode == 0, done.stderr
    assert np.load(output).shape[0] == 2


def test_a_link_or_fifo_at_the_temporary_name_is_never_followed(hub_classifier, tmp_path):
    from packed_transformers.commands import embed as embed_command

    source = input_file(tmp_path / "in.jsonl", ["one text", "another text"])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / ".e.npy.partial").symlink_to(victim)
    assert embed_command.main(embed_argv(hub_classifier, source, tmp_path / "e.npy")) == 2
    assert victim.read_text() == "precious" and not (tmp_path / "e.npy").exists()
    os.mkfifo(tmp_path / ".f.npy.partial")
    started = time.monotonic()
    assert embed_command.main(embed_argv(hub_classifier, source, tmp_path / "f.npy")) == 2
    assert time.monotonic() - started < 60 and (tmp_path / ".f.npy.partial").is_fifo()


def test_an_output_into_a_hub_cache_snapshot_or_its_blobs_is_refused(hub_classifier, tmp_path, capsys):
    """The cache layout: snapshots/REV/FILE -> ../../blobs/HASH. An output naming a snapshot
    file, or any path in blobs, would replace a cached model's file."""
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.common.files import sha256_file

    repo = tmp_path / "hub" / "models--someone--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in hub_classifier.iterdir():
        blob = blobs / sha256_file(file)
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    weights_blob = (snapshot / "model.safetensors").resolve()
    before = weights_blob.read_bytes()
    source = input_file(tmp_path / "in.jsonl", ["one text"])
    for output in (snapshot / "model.safetensors", blobs / "vectors.npy"):
        assert embed_command.main(embed_argv(snapshot, source, output)) == 2
        assert "which this command reads" in capsys.readouterr().err
    assert weights_blob.read_bytes() == before and not (blobs / "vectors.npy").exists()
    assert embed_command.main(embed_argv(snapshot, source, tmp_path / "ok.npy")) == 0  # the cache is usable
