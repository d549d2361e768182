"""Embedding runs keep the rows they finished: a stopped run (signal or kill) continues from them;
rows are tied to the model's file identity; a model changed in place or a damaged record
starts over."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ..conftest import REPO
from ..folder_helpers import embed_argv, input_file


# ----- 11. (low) embed does not hash the model folder's bytes on every run -------------------------
def test_embed_keys_kept_rows_on_file_identity_without_reading_the_weights(
    hub_classifier, tmp_path, monkeypatch
):
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.common import files as common_files

    model = tmp_path / "model"
    shutil.copytree(hub_classifier, model)
    (model / "extra.safetensors").write_bytes(b"\0" * (1 << 20))  # read by a content hash
    hashed = []
    real = common_files.sha256_file
    monkeypatch.setattr(
        common_files, "sha256_file", lambda path, *a: hashed.append(str(path)) or real(path, *a)
    )
    source = input_file(tmp_path / "in.jsonl", ["a text", "another"])
    argv = ["--model", str(model), "--input", str(source), "--output", str(tmp_path / "e.npy"), "--pooling", "mean",
            "--quiet"]  # fmt: skip
    assert embed_command.main(argv) == 0
    assert not [p for p in hashed if p.startswith(str(model))], hashed
    before = common_files.model_files_identity(model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes saved again: a new identity (mtime)
    assert common_files.model_files_identity(model) != before


# ----- 3, 4, 5, 6. commands.embed's kept work, lock, temporary name and output ------------------
def interrupted_after_one_chunk():
    """commands.embed's iter_encode that raises KeyboardInterrupt (Ctrl-C) after its first chunk."""
    from packed_transformers.inference import embedding

    real = embedding.iter_encode

    def stop_after_one_chunk(*args, **kwargs):
        for i, chunk in enumerate(real(*args, **kwargs)):
            if i == 1:
                raise KeyboardInterrupt
            yield chunk

    return stop_after_one_chunk


def test_kept_rows_of_a_model_changed_in_place_are_not_continued(hub_classifier, tmp_path, monkeypatch):
    """Interrupted after its first chunk, the folder then re-saved with other weights: the
    rerun computes every row with the new model (it had mixed old and new rows)."""
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.inference import embedding

    model = tmp_path / "model"
    shutil.copytree(hub_classifier, model)
    texts = [f"text number {i} about london" for i in range(40)]
    source = input_file(tmp_path / "in.jsonl", texts)
    output = tmp_path / "e.npy"
    real, stop_after_one_chunk = embedding.iter_encode, interrupted_after_one_chunk()

    monkeypatch.setattr(embed_command, "iter_encode", stop_after_one_chunk)
    assert embed_command.main([*embed_argv(model, source, output), "--chunk-texts", "8"]) != 0
    assert (tmp_path / ".e.npy.partial").is_file()  # rows kept for a rerun
    monkeypatch.setattr(embed_command, "iter_encode", real)
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights = {k: v * 1.5 if v.dtype.is_floating_point else v for k, v in weights.items()}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})  # a new revision in place
    assert embed_command.main([*embed_argv(model, source, output), "--chunk-texts", "8"]) == 0
    fresh = tmp_path / "fresh.npy"
    assert embed_command.main([*embed_argv(model, source, fresh), "--chunk-texts", "8"]) == 0
    np.testing.assert_allclose(np.load(output), np.load(fresh), rtol=1e-5, atol=1e-6)


def test_a_damaged_record_of_kept_rows_starts_over(hub_classifier, tmp_path, monkeypatch):
    """An interrupted run's .NAME.partial.json edited to rows_written -1, 1.5 or "3" (the
    rest of the record intact): the rows are not trusted, the run starts over and writes
    every row (it was a traceback or a repeated error)."""
    from packed_transformers.commands import embed as embed_command
    from packed_transformers.inference import embedding

    texts = [f"text number {i}" for i in range(24)]
    source = input_file(tmp_path / "in.jsonl", texts)
    reference = tmp_path / "reference.npy"
    assert embed_command.main([*embed_argv(hub_classifier, source, reference), "--chunk-texts", "8"]) == 0
    real, stop_after_one_chunk = embedding.iter_encode, interrupted_after_one_chunk()

    output = tmp_path / "e.npy"
    record = tmp_path / ".e.npy.partial.json"
    for bad in (-1, 1.5, "3"):
        monkeypatch.setattr(embed_command, "iter_encode", stop_after_one_chunk)
        assert embed_command.main([*embed_argv(hub_classifier, source, output), "--chunk-texts", "8"]) != 0
        state = json.loads(record.read_text())
        assert state["rows_written"] == 8
        record.write_text(json.dumps({**state, "rows_written": bad}))
        monkeypatch.setattr(embed_command, "iter_encode", real)
        assert embed_command.main([*embed_argv(hub_classifier, source, output), "--chunk-texts", "8"]) == 0
        np.testing.assert_allclose(np.load(output), np.load(reference), rtol=1e-5, atol=1e-6)
        output.unlink()


@pytest.mark.slow
def test_embed_stopped_by_a_signal_or_a_kill_keeps_its_rows_and_continues_from_them(tmp_path, capsys):
    """SIGTERM, then SIGKILL, mid-run: one line (exit 143) saying how many rows are kept,
    nothing at the output's name; the same command run again continues after the rows
    kept and the array equals an uninterrupted run's, bit for bit (chunks pack alike)."""
    import json

    import numpy as np

    from packed_transformers.data.assets import model_dir

    texts = tmp_path / "t.jsonl"
    texts.write_text(
        "".join(json.dumps({"text": f"text number {i} " + "word " * (i % 40)}) + "\n" for i in range(600))
    )
    argv = [sys.executable, "-m", "packed_transformers.finetune.embed", "--model", str(model_dir()), "--input", str(texts),
            "--chunk-texts", "50", "--quiet"]  # fmt: skip
    state = tmp_path / ".e.npy.partial.json"

    def stopped_after(rows: int, how) -> subprocess.Popen:
        process = subprocess.Popen([*argv, "--output", str(tmp_path / "e.npy")], cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if json.loads(state.read_text())["rows_written"] >= rows:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.02)
        process.send_signal(how)
        process.communicate(timeout=120)
        return process

    terminated = stopped_after(100, signal.SIGTERM)
    _, err = terminated.communicate()
    assert terminated.returncode == 143
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("interrupted: ") and "rows are kept" in last, err
    assert not (tmp_path / "e.npy").exists()
    kept = json.loads(state.read_text())["rows_written"]
    assert 100 <= kept < 600
    killed = stopped_after(kept + 150, signal.SIGKILL)  # continues, then dies without a word
    assert killed.returncode == -signal.SIGKILL and not (tmp_path / "e.npy").exists()
    done = subprocess.run(
        [*argv, "--output", str(tmp_path / "e.npy")], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0 and "continuing after the" in done.stderr, done.stderr[-2000:]
    # its summary counts what it embedded itself, and what it kept (issue 108 item 8: 2,000 texts
    # and their rate, for 1,500 embedded)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    again = json.loads(state.read_text())["rows_written"] if state.exists() else None
    assert again is None and summary["texts"] == 600
    assert (
        summary["embedded_now"] + summary["kept_from_earlier_run"] == 600
        and summary["kept_from_earlier_run"] >= kept
    )
    # the rate over its own texts (the summary rounds seconds to 1 ms and the rate to 0.1: compared so)
    assert summary["texts_per_second"] == pytest.approx(
        summary["embedded_now"] / summary["seconds"], rel=2e-3, abs=0.1
    )
    whole = subprocess.run(
        [*argv, "--output", str(tmp_path / "whole.npy")], cwd=REPO, capture_output=True, text=True
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), np.load(tmp_path / "whole.npy"))
    # no partial left, and no lock file (issue 108 item 5: every embed left its 0-byte
    # `.NAME.npy.lock`; the killed run's is taken and removed by the run after it)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "e.npy",
        "t.jsonl",
        "whole.npy",
    ]
    # a finished output is never replaced without --overwrite (one line, before any model loads)
    from packed_transformers.commands import embed

    before = (tmp_path / "e.npy").stat().st_mtime_ns
    capsys.readouterr()
    assert embed.main([*argv[3:], "--output", str(tmp_path / "e.npy")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --output {tmp_path / 'e.npy'}: holds a finished output; give --overwrite to replace it, or another path"
    ]
    assert (tmp_path / "e.npy").stat().st_mtime_ns == before


def test_chunks_follow_the_seconds_of_work_they_hold():
    """Issue 110 item 3: rows are kept chunk by chunk, and a chunk was 8,192 texts whatever the
    model's speed, so Ctrl-C kept nothing below 8,192 (the README's 5,000-text example). Chunks
    are now about --chunk-seconds of work at the measured rate, never above --chunk-texts."""
    from packed_transformers.inference.embedding import FEWEST_CHUNK_TEXTS, FIRST_CHUNK_TEXTS, ChunkSizes

    sizes = ChunkSizes(8192, 10.0)
    assert sizes.next_size() == FIRST_CHUNK_TEXTS  # no rate yet
    sizes.observe(256, 1.0)
    assert sizes.next_size() == 2560  # 256 texts/s for 10 s
    sizes.observe(256, 0.01)
    assert sizes.next_size() == 8192  # never above --chunk-texts
    sizes.observe(10, 100.0)
    assert sizes.next_size() == FEWEST_CHUNK_TEXTS  # a batch at least
    assert ChunkSizes(8192, None).next_size() == ChunkSizes(8192, 0.0).next_size() == 8192
    assert ChunkSizes(50, 10.0).next_size() == 50


@pytest.mark.slow  # MiniLM on 3,000 texts, stopped after its first chunk
def test_ctrl_c_keeps_rows_below_the_largest_chunk_with_the_defaults(tmp_path):
    """The command as the README runs it (no chunk option): Ctrl-C after the first chunk keeps
    its rows, on an input far below --chunk-texts."""
    from packed_transformers.data.assets import model_dir

    texts = tmp_path / "t.jsonl"
    texts.write_text(
        "".join(json.dumps({"text": f"text number {i} " + "word " * (i % 60)}) + "\n" for i in range(3000))
    )
    state = tmp_path / ".e.npy.partial.json"
    process = subprocess.Popen([sys.executable, "-m", "packed_transformers", "embed", "--model", str(model_dir()), "--input",
                                str(texts), "--output", str(tmp_path / "e.npy"), "--quiet"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline, kept = time.monotonic() + 300, 0
    while time.monotonic() < deadline and process.poll() is None and not kept:
        try:
            kept = json.loads(state.read_text())["rows_written"]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    assert 0 < kept < 3000 and json.loads(state.read_text())["rows_written"] >= kept, err[-2000:]
    assert f"rows are kept in {tmp_path / '.e.npy.partial'}" in err.strip().splitlines()[-1]
