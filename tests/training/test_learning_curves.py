"""The pieces behind `make demo` and bench/bench_convergence.py: the memory-mapped shard
reader, training time that leaves out evaluation, the unigram baseline, the summary's
plot, the convergence verdict and the corpus vocabulary."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from packed_transformers.common.files import sha256_file
from packed_transformers.components.curves import eval_curve, masked_labels, unigram_baseline
from packed_transformers.components.data import PackedShards
from packed_transformers.packing.format import PACKED_FIELDS
from packed_transformers.packing.shards import PackedDataset

from ..conftest import REPO
from ..training_helpers import metrics, run, write_config

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow


def h5py_rows(dataset: PackedDataset, packs: list[int]) -> dict:
    """The rows as plain h5py reads them, one by one (the reference for the reader)."""
    starts = np.cumsum([0] + [int(s["packs"]) for s in dataset.shards])
    out = {name: [] for name in PACKED_FIELDS}
    for pack in packs:
        shard = int(np.searchsorted(starts, pack, side="right") - 1)
        with h5py.File(dataset.shard_path(shard), "r") as f:
            for name in PACKED_FIELDS:
                out[name].append(f[name][pack - starts[shard]])
    return {name: np.stack(rows) for name, rows in out.items()}


def test_memory_mapped_reader_equals_h5py_and_falls_back_for_chunked_shards(packed, tmp_path):
    dataset = PackedDataset.open(packed / "train")
    assert len(dataset.shards) > 1
    rng = np.random.default_rng(0)
    packs = rng.permutation(dataset.packs)[:23].tolist()  # unsorted, across shards, one repeated
    packs.append(packs[3])
    expected = h5py_rows(dataset, packs)
    batch = PackedShards(dataset)[packs]
    for name in PACKED_FIELDS:
        assert np.array_equal(batch[name].numpy(), expected[name]), name

    # The same shards rewritten chunked and compressed (another writer): read through h5py.
    copy = tmp_path / "chunked"
    shutil.copytree(packed / "train", copy)
    for shard in sorted(copy.glob("part-*.h5")):
        with h5py.File(shard, "r") as f:
            fields = {name: f[name][:] for name in f}
            attrs = dict(f.attrs)
        with h5py.File(shard, "w") as f:
            f.attrs.update(attrs)
            for name, values in fields.items():
                f.create_dataset(name, data=values, chunks=True, compression="gzip")
    # ... with metadata.json recording the new files (the reader checks each shard's size)
    meta = json.loads((copy / "metadata.json").read_text())
    for record in meta["shards"]:
        record.update(bytes=(copy / record["name"]).stat().st_size, sha256=sha256_file(copy / record["name"]))
    (copy / "metadata.json").write_text(json.dumps(meta))
    reader = PackedShards(PackedDataset.open(copy))
    chunked = reader[packs]
    assert not any(isinstance(v, np.memmap) for v in reader._shard_fields(0).values())
    for name in PACKED_FIELDS:
        assert np.array_equal(chunked[name].numpy(), expected[name]), name


def test_unigram_baseline_is_the_most_frequent_training_label_on_the_eval_packs(packed):
    train = masked_labels(PackedDataset.open(packed / "train"))
    token = int(np.bincount(train).argmax())
    eval_labels = masked_labels(PackedDataset.open(packed / "eval"))
    got_token, accuracy = unigram_baseline(packed / "train", packed / "eval", max_sequences=10**9)
    assert got_token == token
    assert accuracy == pytest.approx(float((eval_labels == token).mean()))
    # Fewer eval sequences: the first packs only, as the run's evaluation takes them.
    _, few = unigram_baseline(packed / "train", packed / "eval", max_sequences=10)
    assert 0.0 <= few <= 1.0


def test_training_time_leaves_out_evaluation_and_survives_resume(packed, tmp_path):
    config = write_config(
        tmp_path / "c.yaml",
        packed,
        training={"max_steps": 12, "checkpoint_every_steps": 6},
        eval={"every_samples": 20, "max_sequences": 100, "at_end": True},
    )
    first = run(config, tmp_path / "run", "--set", "training.max_steps=6")
    assert first.returncode == 0, first.stderr
    second = run(config, tmp_path / "run", "--resume")
    assert second.returncode == 0, second.stderr
    train = metrics(tmp_path / "run")
    evals = metrics(tmp_path / "run", "eval")
    ends = metrics(tmp_path / "run", "end")
    assert [r["step"] for r in train] == list(range(1, 13))
    seconds = [r["train_seconds"] for r in train]
    assert all(b > a for a, b in zip(seconds, seconds[1:])), "training time only grows, across the resume"
    assert len(evals) >= 4
    # Each evaluation is stamped with the training time at which it happened.
    for record in evals:
        same_step = [r for r in train if r["step"] == record["step"]]
        assert record["train_seconds"] >= same_step[0]["train_seconds"] - 1e-9
    # The first process's training time is below its wall time by at least its evaluations.
    assert ends[0]["train_seconds"] < ends[0]["seconds"]
    curve = eval_curve(tmp_path / "run")
    assert np.all(np.diff(curve["samples"]) > 0) and curve["mlm_accuracy"].shape == curve["samples"].shape


def test_max_train_seconds_stops_the_run(packed, tmp_path):
    config = write_config(
        tmp_path / "c.yaml", packed, training={"max_steps": 10**6, "max_train_seconds": 2.0}
    )
    done = run(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    end = metrics(tmp_path / "run", "end")[-1]
    assert 2.0 <= end["train_seconds"] < 10.0
    assert end["step"] < 10**6
    # the record says what ended it (MLPerf's run_stop stays "aborted": its rules' word for
    # any end short of the target), and the steps after the last log line are counted
    assert end["stopped_by"] == "max_train_seconds" and end["status"] == "aborted"
    train = metrics(tmp_path / "run", "train")
    assert train[-1]["step"] == end["step"] and sum(r["sequences"] for r in train) == end["samples"]
    from packed_transformers.training.summary import run_figures

    figures = run_figures(tmp_path / "run")
    assert figures["sequences_per_second"] > 0 and figures["final_train_loss"] is not None
    assert figures["stopped_by"] == "max_train_seconds"


def test_summary_prints_speedup_baseline_and_plots(packed, tmp_path):
    config = write_config(
        tmp_path / "c.yaml", packed, training={"max_steps": 8}, eval={"every_samples": 30, "at_end": True}
    )
    for name in ("packed", "unpacked"):
        assert run(config, tmp_path / name).returncode == 0
    plot = tmp_path / "curves.png"
    done = subprocess.run(
        [sys.executable, "-m", "packed_transformers.training.summary", "--packed", str(tmp_path / "packed"), "--unpacked",
         str(tmp_path / "unpacked"), "--plot", str(plot)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "realized speed-up" in done.stdout and "unigram baseline" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_convergence", REPO / "bench" / "bench_convergence.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_convergence_verdict_names_equal_different_and_inconclusive():
    bench = load_bench()
    same = np.array([0.100, 0.101, 0.099, 0.100])
    assert bench.verdict(same, same + 0.0005, margin=0.01)[0].startswith("equivalent")
    assert bench.verdict(same, same + 0.05, margin=0.01)[0] == "different"
    noisy = np.array([0.08, 0.12, 0.10])
    assert bench.verdict(noisy, noisy[::-1] + 0.001, margin=0.005)[0].startswith("inconclusive")
    # Welch's interval against scipy's own t-test: the 95% interval excludes 0 iff p < 0.05.
    from scipy import stats

    rng = np.random.default_rng(1)
    for _ in range(20):
        a, b = rng.normal(0.1, 0.01, 3), rng.normal(0.11, 0.02, 4)
        _, lo, hi = bench.welch_interval(a, b, 0.95)
        p = stats.ttest_ind(a, b, equal_var=False).pvalue
        assert (lo > 0 or hi < 0) == (p < 0.05)


def test_corpus_vocabulary_feeds_data_creation(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = ["packing", "removes", "padding", "bert", "learns", "the", "sequence", "tokens", "of", "a"]
    for i in range(30):
        sentences = [" ".join(rng.choice(words, 8)).capitalize() + "." for _ in range(12)]
        (corpus / f"{i}.txt").write_text(" ".join(sentences))
    (corpus / "legacy.txt").write_bytes("Caf\xe9 prices rose.".encode("cp1252"))  # not UTF-8
    vocab = tmp_path / "out" / "vocab.txt"
    cmd = [
        sys.executable,
        "-m",
        "packed_transformers.data.train_vocab",
        "--input",
        str(corpus / "*.txt"),
        "--vocab-size",
        "120",
    ]
    done = subprocess.run([*cmd, "--output", str(vocab)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    tokens = vocab.read_text().splitlines()
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(tokens) == len(set(tokens)) <= 120 and "packing" in tokens
    created = subprocess.run(
        [sys.executable, "-m", "packed_transformers.data.create_pretraining_data", "--input", str(corpus / "*.txt"),
         "--input-format", "one-document-per-file", "--vocab", str(vocab), "--output", str(tmp_path / "data"),
         "--max-seq-length", "64", "--max-predictions-per-seq", "10", "--quiet"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    bad = subprocess.run(
        [*cmd[:-1], "3", "--output", str(tmp_path / "bad" / "vocab.txt")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--vocab-size" in bad.stderr and bad.stderr.count("\n") == 1
    assert not (tmp_path / "bad" / "vocab.txt").exists()


def figures(sequences: int, seconds: float, accuracies: list[float]) -> dict:
    """A run's figures as training.summary.run_figures gives them, evaluated evenly."""
    points = np.linspace(1, len(accuracies), len(accuracies)) / len(accuracies)
    curve = {"samples": points * sequences, "train_seconds": points * seconds,
             "mlm_accuracy": np.array(accuracies), "mlm_loss": np.zeros(len(accuracies))}  # fmt: skip
    return {
        "sequences": sequences,
        "train_seconds": seconds,
        "eval_mlm_accuracy": accuracies[-1],
        "curve": curve,
    }


def test_the_demo_comparison_ends_in_a_verdict_only_when_both_runs_learned():
    from packed_transformers.training.summary import comparison

    packed = figures(6000, 50.0, [0.03, 0.06, 0.09])
    unpacked = figures(6000, 100.0, [0.03, 0.05, 0.08])
    lines = comparison(packed, unpacked, baseline=0.04)
    assert lines[0].startswith("at equal sequences (6,000): packed 50 s vs unpacked 100 s")
    assert (
        "at equal training time (50 s): eval MLM accuracy packed 0.0900 vs unpacked 0.0300" in lines[1]
    )  # its last eval by 50 s
    assert lines[-1].startswith(
        "verdict: packed trained the same 6,000 sequences in 50 s, unpacked in 100 s (2.00x)"
    )
    stalled = figures(6000, 100.0, [0.02, 0.03, 0.035])  # under the baseline at its end
    last = comparison(packed, stalled, baseline=0.04)[-1]
    assert last.startswith("inconclusive: the unpacked run did not pass the unigram baseline (0.0400)")
    assert "DEMO_SEQUENCES=12,000" in last
    never = dict(unpacked, eval_mlm_accuracy=None)
    assert comparison(packed, never, baseline=0.04)[-1].startswith(
        "inconclusive: the unpacked run never evaluated"
    )
