"""Packed inference on Ray Data (ray_jobs/actors.py, ray_jobs/job.py), judged on a real
local cluster of two nodes of one CPU each (ray.cluster_utils.Cluster): `--ray` output
equals the single-process command's row for row, every index exactly once, also when a
worker process is SIGKILLed mid-job; the Python API inside a user's own map_batches; bad
inputs refused in one line with nothing written."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# Found, not imported, at collection: importing Ray costs each test worker ~4 s, which the
# fast loop (where every test here is deselected as slow) would pay for nothing.
if importlib.util.find_spec("ray") is None:
    pytest.skip("make install-ray (the Ray tests run under make test)", allow_module_level=True)

from packed_transformers.data.assets import corpus_glob, model_dir  # noqa: E402
from packed_transformers.data.embedding_texts import bbc_articles, texts_of  # noqa: E402

from ..conftest import REPO  # noqa: E402
from ..family_helpers import save_family_folder  # noqa: E402

pytestmark = pytest.mark.slow
TEXTS = [t for t in texts_of(bbc_articles(corpus_glob())[:30], "sentences") if t.strip()][:150]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    two_nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    two_nodes.add_node(num_cpus=1)
    yield two_nodes
    import ray

    ray.shutdown()
    two_nodes.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A folder of JSON lines (90 rows) and Parquet (60 rows in row groups of 16): the
    single-process reference reads their concatenation in sorted file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("inputs")
    with (folder / "a.jsonl").open("w") as f:
        for text in TEXTS[:90]:
            f.write(json.dumps({"text": text}) + "\n")
    pq.write_table(pa.table({"text": TEXTS[90:]}), folder / "b.parquet", row_group_size=16)
    joined = folder.parent / "joined.jsonl"
    joined.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return folder, joined


def command(module: str, *arguments, check: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", module, *map(str, arguments)], cwd=REPO, capture_output=True, text=True
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def refused_here(capsys, *arguments) -> str:
    """commands.embed's refusal run in this process (a mistake answered before any cluster
    starts: no interpreter to start) -> its one stderr line; exit code 2 asserted."""
    from packed_transformers.commands import embed

    capsys.readouterr()
    assert embed.main([str(a) for a in arguments]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def started(module: str, *arguments) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *map(str, arguments)], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def gathered(folder: Path, suffix: str):
    out = folder.parent / f"{folder.name}-gathered{suffix}"
    command("packed_transformers.finetune.ray_job", "gather", folder, "--output", out, check=True)
    return np.load(out) if suffix == ".npy" else [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def embedded(cluster, inputs, tmp_path_factory):
    """The single-process command's embeddings of the joined inputs, and a finished --ray
    job over the input folder (two replicas, one per node)."""
    folder, joined = inputs
    scratch = tmp_path_factory.mktemp("embedded")
    command(
        "packed_transformers.finetune.embed",
        "--model",
        model_dir(),
        "--input",
        joined,
        "--output",
        scratch / "one.npy",
        check=True,
    )
    out = scratch / "shards"
    done = command("packed_transformers.finetune.embed", "--model", model_dir(), "--input", folder, "--output", out,
                   "--ray", cluster.address, "--workers", 2, "--chunk-rows", 32, "--quiet", check=True)  # fmt: skip
    return np.load(scratch / "one.npy"), out, json.loads(done.stdout.splitlines()[-1])


def test_embed_on_ray_equals_the_single_process_command(embedded):
    expected, out, summary = embedded
    assert summary["rows"] == len(TEXTS)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == len(TEXTS) and len(manifest["shards"]) == 3 + 4  # 90 lines / 32, 4 row groups
    got = gathered(out, ".npy")
    assert got.shape == expected.shape
    assert float((got * expected).sum(1).min()) >= 0.99999  # both normalized (MiniLM's Normalize)


def decoder_classifier(folder):
    """A Llama-shaped XxxForSequenceClassification folder with a byte-level BPE tokenizer."""
    import torch
    import transformers

    from ..decoder_helpers import decoder_tokenizer, tiny_config

    tokenizer = decoder_tokenizer()
    torch.manual_seed(0)
    config = tiny_config("llama", num_labels=3, vocab_size=len(tokenizer))
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["xlm-roberta", "llama"])
def test_predict_on_ray_equals_the_single_process_command_for_a_family_folder(
    cluster, inputs, tmp_path, family
):
    """An encoder family and a decoder (its last token's score) alike."""
    folder, joined = inputs
    if family == "llama":
        model = decoder_classifier(tmp_path / "llama")
    else:
        model = save_family_folder(tmp_path / "xlmr", "xlm-roberta", "classification")
    command(
        "packed_transformers.finetune.predict",
        "--model",
        model,
        "--input",
        joined,
        "--output",
        tmp_path / "one.jsonl",
        check=True,
    )
    out = tmp_path / "shards"
    command("packed_transformers.finetune.predict", "--model", model, "--input", folder, "--output", out, "--ray", cluster.address,
            "--workers", 1, "--chunk-rows", 40, "--quiet", check=True)  # fmt: skip
    expected = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    got = gathered(out, ".jsonl")
    assert [r["index"] for r in got] == list(range(len(TEXTS)))
    assert [r["label"] for r in got] == [r["label"] for r in expected]
    np.testing.assert_allclose(
        [list(r["scores"].values()) for r in got], [list(r["scores"].values()) for r in expected], atol=2e-6
    )
    assert [list(r["scores"]) for r in got] == [
        list(r["scores"]) for r in expected
    ]  # label names, class order


def writer_processes() -> list[int]:
    """PIDs of the Ray actor processes running ShardWriter (Ray sets their titles)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "ShardWriter" in title:
                found.append(int(entry.name))
    return found


def test_a_worker_killed_mid_job_still_gives_every_row_once(cluster, inputs, embedded, tmp_path):
    """Over a copy of a finished job's folder with --overwrite: the old folder stays whole
    until the new one is complete."""
    import shutil

    folder, _ = inputs
    expected, finished, _ = embedded
    out = tmp_path / "shards"
    shutil.copytree(finished, out)
    job = started("packed_transformers.finetune.embed", "--model", model_dir(), "--input", folder, "--output", out, "--ray",
                  cluster.address, "--chunk-rows", 4, "--quiet", "--overwrite")  # fmt: skip
    killed, deadline = None, time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and job.poll() is None:
        shards = list(tmp_path.glob(".shards.partial/part-*.parquet"))
        writers = writer_processes()
        if len(shards) >= 3 and writers:  # mid-job: some shards written, most not
            assert (out / "manifest.json").exists()  # the finished folder is untouched meanwhile
            os.kill(writers[0], signal.SIGKILL)
            killed = writers[0]
        time.sleep(0.05)
    stdout, stderr = job.communicate(timeout=600)
    assert killed is not None, "no writer was running mid-job to kill"
    assert job.returncode == 0, stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) == 23 + 4  # the new job's chunks: 90 lines / 4, and 4 row groups
    got = gathered(out, ".npy")  # gather checks indices 0..N-1 once each
    assert float((got * expected).sum(1).min()) >= 0.99999


def test_the_python_api_runs_inside_a_users_own_map_batches(cluster, tmp_path):
    import ray
    import ray.data

    from packed_transformers.inference.embedding import encode, load_encoder
    from packed_transformers.ray_jobs.actors import PackedEmbedder, embed_dataset

    ray.init(address=cluster.address, ignore_reinit_error=True, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    texts = TEXTS[:40]
    users = ray.data.from_items([{"text": t, "id": i} for i, t in enumerate(texts)]).filter(
        lambda r: r["id"] % 2 == 0
    )
    mine = users.map_batches(PackedEmbedder, fn_constructor_kwargs={"model": str(model_dir())}, batch_size=8,
                             compute=ray.data.ActorPoolStrategy(size=1), batch_format="pandas")  # fmt: skip
    # One replica: the cluster's other CPU runs the user's filter (two would hold both CPUs).
    rows = sorted(mine.take_all(), key=lambda r: r["id"])
    expected = encode(texts[::2], load_encoder(model_dir()))
    assert [r["id"] for r in rows] == list(range(0, 40, 2))
    got = np.stack([np.asarray(r["embedding"], dtype=np.float32) for r in rows])
    assert float((got * expected).sum(1).min()) >= 0.99999
    helper = embed_dataset(ray.data.from_items([{"text": t} for t in texts[:6]]), model_dir(), concurrency=1)
    assert len(helper.take_all()[0]["embedding"]) == expected.shape[1]
    from packed_transformers.inference.int8 import int8_problem

    if (
        int8_problem("cpu") is None
    ):  # int8 in the actors (tests/inference/test_int8.py: the same gate elsewhere)
        eight = ray.data.from_items([{"text": t, "id": i} for i, t in enumerate(texts[::2])]).map_batches(
            PackedEmbedder, fn_constructor_kwargs={"model": str(model_dir()), "dtype": "int8"}, batch_size=8,
            compute=ray.data.ActorPoolStrategy(size=1), batch_format="pandas",
        )  # fmt: skip
        rows = sorted(eight.take_all(), key=lambda r: r["id"])
        got = np.stack([np.asarray(r["embedding"], dtype=np.float32) for r in rows])
        similar = (got * expected).sum(1)
        assert similar.min() >= 0.965 and np.median(similar) >= 0.99, similar
        assert not np.allclose(got, expected, atol=1e-4)  # it ran in int8


def test_bad_inputs_are_refused_in_one_line_with_nothing_written(cluster, inputs, embedded, tmp_path, capsys):
    """Refused before any cluster work (a bad line inside a job, its rows kept, is
    test_kept_shards_are_tied_to_the_model_and_checked...)."""
    folder, joined = inputs
    ray_args = ("--ray", cluster.address, "--workers", 1, "--chunk-rows", 8, "--quiet")
    not_parquet = tmp_path / "np"
    not_parquet.mkdir()
    (not_parquet / "y.parquet").write_text("not parquet")
    line = refused_here(
        capsys, "--model", model_dir(), "--input", not_parquet, "--output", tmp_path / "o2", *ray_args
    )
    assert line.startswith(f"error: {not_parquet / 'y.parquet'}: not a readable Parquet")

    _, finished, _ = embedded
    before = (finished / "manifest.json").read_text()
    assert "--overwrite" in refused_here(capsys, "--model", model_dir(), "--input", joined, "--output", finished,
                                         *ray_args)  # fmt: skip
    assert (finished / "manifest.json").read_text() == before
    over = refused_here(capsys, "--model", model_dir(), "--input", folder, "--output", folder, *ray_args)
    assert "never replaces an input" in over
    assert sorted(p.name for p in folder.iterdir()) == ["a.jsonl", "b.parquet"]
    glob_none = refused_here(capsys, "--model", model_dir(), "--input", tmp_path / "*.nothing", "--output", tmp_path / "out",
                             *ray_args)  # fmt: skip
    assert "matches no file" in glob_none


def test_batches_from_parquet_or_a_user_meet_the_commands_rules_in_one_line():
    """Parquet rows and users' batches never pass the JSON-lines reader: the same rules
    (embed: a non-empty string; predict: any string, pairs may be None; valid Unicode; at
    most MAX_FIELD_CHARS) are applied to them, naming the row."""
    from packed_transformers.data.classification_data import MAX_FIELD_CHARS, ExampleError
    from packed_transformers.ray_jobs.actors import checked_texts

    def where(i):
        return f"b.parquet: row {i}"

    cases = [
        (["a", 3], {}, "b.parquet: row 1: column 'text' must be a string, got int '3'"),
        (["a", " "], {}, "row 1: column 'text' is empty"),
        (["a", None], {"empty_ok": True}, "row 1: column 'text' must be a string, got None"),
        (["\ud800"], {}, "row 0: column 'text': not valid Unicode (a lone surrogate U+D800"),
        (["x" * (MAX_FIELD_CHARS + 1)], {}, f"column 'text' has {MAX_FIELD_CHARS + 1:,} characters"),
    ]
    for texts, rules, says in cases:
        with pytest.raises(ExampleError, match=re.escape(says)):
            checked_texts(texts, "text", where, **rules)
    assert checked_texts(["", None, "b"], "pair", where, empty_ok=True, none_ok=True) == ["", None, "b"]


def test_kept_shards_are_tied_to_the_model_and_checked_and_an_unreachable_cluster_is_one_line(
    cluster, tmp_path
):
    """Reliability 6: kept shards of a model changed in place are recomputed; a damaged kept
    shard is recomputed, not failed on at every rerun; an address where no cluster answers
    is one line within seconds, with nothing left beside the output."""
    import shutil
    import socket

    model = tmp_path / "model"
    shutil.copytree(model_dir(), model, ignore=shutil.ignore_patterns("onnx", "openvino"))
    lines = [json.dumps({"text": t}) for t in TEXTS[:32]]
    lines[30] = '{"text": "unterminated'
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    ray_args = ("--ray", cluster.address, "--workers", 1, "--chunk-rows", 8, "--quiet")
    first = command(
        "packed_transformers.finetune.embed", "--model", model, "--input", source, "--output", out, *ray_args
    )
    assert first.returncode == 2, first.stderr[-2000:]
    last = first.stderr.strip().splitlines()[-1]  # one line naming the file and line
    assert last.startswith("error: ") and f"{source}:31" in last, first.stderr[-2000:]
    assert "other 24 rows are kept" in last and not out.exists()  # 3 of 4 chunks kept, nothing half-written
    partial = tmp_path / ".out.partial"
    shard = sorted(partial.glob("part-*"))[0]
    shard.write_bytes(shard.read_bytes()[:40])  # a damaged kept shard
    lines[30] = json.dumps({"text": "fixed"})
    source.write_text("\n".join(lines) + "\n")
    again = command(
        "packed_transformers.finetune.embed",
        "--model",
        model,
        "--input",
        source,
        "--output",
        out,
        *ray_args,
        check=True,
    )
    summary = json.loads(again.stdout.splitlines()[-1])
    assert (summary["chunks_run"], summary["chunks_kept"]) == (2, 2)  # the refused chunk and the damaged one
    assert len(gathered(out, ".npy")) == 32 and not partial.exists()

    # the same job after the model was re-saved in place: nothing kept from the old weights
    second_out = tmp_path / "out2"
    lines[5] = '{"text": "broken'
    source.write_text("\n".join(lines) + "\n")
    assert command("packed_transformers.finetune.embed", "--model", model, "--input", source, "--output", second_out,
                   *ray_args).returncode == 2  # fmt: skip
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-5}))
    lines[5] = json.dumps({"text": "fixed too"})
    source.write_text("\n".join(lines) + "\n")
    redone = command("packed_transformers.finetune.embed", "--model", model, "--input", source, "--output", second_out, *ray_args,
                     check=True)  # fmt: skip
    assert json.loads(redone.stdout.splitlines()[-1])["chunks_kept"] == 0

    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started_at = time.monotonic()
    done = command("packed_transformers.finetune.embed", "--model", model, "--input", source, "--output", tmp_path / "o3",
                   "--ray", f"127.0.0.1:{port}", "--quiet")  # fmt: skip
    assert done.returncode == 2 and time.monotonic() - started_at < 60
    assert (
        "Traceback" not in done.stderr
        and "no Ray cluster answers there" in done.stderr.strip().splitlines()[-1]
    )
    assert not (tmp_path / ".o3.partial").exists()


def test_each_ray_process_parses_config_json_once_and_builds_one_tokenizer(inputs, tmp_path):
    """`packed embed --ray local` as a user runs it, counted in every process (the driver and
    the actors, which inherit the counting environment: tests/counting/sitecustomize.py): each
    opens the model folder's config.json at most once and builds at most one tokenizer, and
    both the driver (which checks the folder before the cluster starts) and the actor that
    embeds open it. The counting itself is shown failing on planted second readers in
    tests/door/test_read_once.py."""
    from ..house_helpers import counting_environment

    folder, _ = inputs
    env, _ = counting_environment(model_dir(), tmp_path)
    env["COUNT_OUTPUT"] = str(tmp_path / "counts-{pid}.json")
    done = subprocess.run([sys.executable, "-m", "packed_transformers", "embed", "--model", model_dir(), "--input",
                           folder, "--output", tmp_path / "out", "--ray", "local", "--workers", "1", "--quiet"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    counts = [json.loads(path.read_text()) for path in tmp_path.glob("counts-*.json")]
    opened = [c for c in counts if c["config_json"] or c["tokenizer_builds"]]
    assert all(c["config_json"] <= 1 and c["tokenizer_builds"] <= 1 for c in counts), counts
    assert opened.count({"config_json": 1, "tokenizer_builds": 1}) >= 2, counts  # the driver and an actor
