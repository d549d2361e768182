"""The graph cache (inference/graph_cache.py) degrades and never fails a run (reliability 9,
items 5 and 6): a cache that is a file, read-only, or whose writer raises its own error type
on a full disk costs one warning line, the run goes on, and nothing temporary is left; the
temporaries of a process that died are removed by the next writer."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from packed_transformers.inference import graph_cache


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(graph_cache, "_warned", set())


def entries(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_an_entry_appears_whole_and_is_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(graph_cache.CACHE_VARIABLE, str(tmp_path))
    assert graph_cache.cached_file("onnxruntime", "k1", "model.onnx") is None
    assert graph_cache.keep("onnxruntime", "k1", lambda folder: (folder / "model.onnx").write_bytes(b"graph"))
    assert graph_cache.cached_file("onnxruntime", "k1", "model.onnx").read_bytes() == b"graph"
    assert entries(tmp_path / "onnxruntime") == ["k1"]  # no temporary beside it
    monkeypatch.setenv(graph_cache.CACHE_VARIABLE, "")  # the cache off
    assert graph_cache.cached_file("onnxruntime", "k1", "model.onnx") is None
    assert graph_cache.keep("onnxruntime", "k2", lambda folder: None) is False


def test_a_writer_failing_as_on_a_full_disk_is_one_warning_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    """openvino.save_model on a full disk raised RuntimeError('basic_ios::clear: iostream
    error'), which the OSError-only handler let through (rc 1) with its half-written folder."""
    monkeypatch.setenv(graph_cache.CACHE_VARIABLE, str(tmp_path))

    def full_disk(folder):
        (folder / "model.bin").write_bytes(b"half")
        raise RuntimeError("basic_ios::clear: iostream error")

    with caplog.at_level(logging.WARNING):
        assert graph_cache.keep("openvino", "k", full_disk) is False
        assert graph_cache.keep("openvino", "k", full_disk) is False
    assert entries(tmp_path / "openvino") == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot be written (basic_ios::clear: iostream error)" in warnings[0]


@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_a_cache_that_cannot_be_written_runs_without_it(kind, tmp_path, monkeypatch, caplog):
    if kind == "a file":
        root = tmp_path / "cache-file"
        root.write_text("not a folder")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes through a read-only mode; the file case stands for it here")
        root = tmp_path / "ro"
        root.mkdir()
        root.chmod(0o555)
    monkeypatch.setenv(graph_cache.CACHE_VARIABLE, str(root))
    with caplog.at_level(logging.WARNING):
        assert graph_cache.cached_file("onnxruntime", "k", "model.onnx") is None
        assert graph_cache.keep("onnxruntime", "k", lambda folder: (folder / "m").write_bytes(b"x")) is False
        assert graph_cache.writable_folder(root / "openvino" / "compiled") is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "running without it" in warnings[0], warnings


def test_the_temporaries_of_a_dead_process_are_removed_by_the_next_writer(tmp_path, monkeypatch):
    monkeypatch.setenv(graph_cache.CACHE_VARIABLE, str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    root = tmp_path / "openvino"
    (root / f".fp32-abc.tmp-{pid}-x1y2").mkdir(parents=True)
    (root / f".fp32-abc.tmp-{pid}-x1y2" / "model.bin").write_bytes(b"half")
    (root / f".fp32-def.tmp-{os.getpid()}-live").mkdir()  # a running process's: kept
    assert graph_cache.keep("openvino", "k", lambda folder: (folder / "model.xml").write_text("x"))
    assert entries(root) == [f".fp32-def.tmp-{os.getpid()}-live", "k"]


OPENVINO_WITH_A_FILE_AS_CACHE = """
import json, sys
import numpy as np
from packed_transformers.inference.embedding import encode, load_encoder
from packed_transformers.inference.options import InferenceOptions
encoder = load_encoder(sys.argv[1], pooling=["mean"])
texts = ["the market rose", "a film", "team win the vote"]
ours = encode(texts, encoder, InferenceOptions.for_embedding(runtime=sys.argv[2]))
torch = encode(texts, encoder)
print(json.dumps(float(np.abs(ours - torch).max())))
"""


@pytest.mark.slow  # a graph converted for each runtime
@pytest.mark.parametrize("runtime", ["openvino", "onnxruntime"])
def test_each_graph_runtime_embeds_with_a_file_as_its_cache(runtime, checkpoint, tmp_path):
    """Item 5: with PACKED_TRANSFORMERS_CACHE a regular file, `--runtime openvino` ended rc 1
    with a 40-line "Couldn't create directory" traceback (its CACHE_DIR); now it embeds as
    torch does, with one warning line per cache, and no traceback."""
    pytest.importorskip(runtime)
    cache = tmp_path / "cache"
    cache.write_text("a file")
    done = subprocess.run([sys.executable, "-c", OPENVINO_WITH_A_FILE_AS_CACHE, str(checkpoint), runtime],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PACKED_TRANSFORMERS_CACHE=str(cache)))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 2e-5
    assert "Traceback" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if "graph cache" in line]
    assert len(warnings) == 1 and "running without it" in warnings[0], done.stderr
    assert cache.read_text() == "a file"
