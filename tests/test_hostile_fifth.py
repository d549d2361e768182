"""The fifth hostile test (issue: reliability 5): outputs that would replace what is not a
regular file, an admission estimate that locked out a legal request, and the cases after
them. Each test fails without its fix."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from packed_transformers.common.files import atomic_folder, atomic_path, output_file, output_over_inputs
from packed_transformers.serving.admission import ADMIT_WITHIN, MeasuredRates, bucket_of, refusal

from .conftest import REPO
from .folder_helpers import one_line_error, run_module, tiny_hub_classifier  # noqa: F401


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


# ----- 2. admission that a run of tiny batches cannot lock --------------------------------------
def tiny_then_large_rates():
    """What seven one-word requests teach: ~7 tokens in ~14 ms (500 tokens/s)."""
    rates = MeasuredRates()
    for _ in range(7):
        rates.observe(7, 0.014)
    return rates


def test_an_empty_queue_admits_whatever_was_measured():
    rates = tiny_then_large_rates()
    # 32 texts of ~400 tokens: 12,800 tokens, 25 s at the tiny batches' rate; timeout 30 s.
    assert refusal(0, 0, 32, 12_800, rates, 1024, 16_384, 30.0) is None


def test_an_estimate_from_small_batches_does_not_refuse_a_larger_batch():
    rates = tiny_then_large_rates()
    assert rates.rate_for(12_800) is None and rates.rate_for(8) == rates.rate_for(5) == rates.rate_for(15)
    assert refusal(1, 7, 32, 12_800, rates, 1024, 16_384, 30.0) is None


def test_the_rate_of_each_batch_size_decides_and_a_full_queue_is_refused():
    rates = MeasuredRates()
    rates.observe(16_000, 2.0)  # 8,000 tokens/s at full batches
    rates.observe(10, 0.02)  # 500 tokens/s for tiny ones
    assert bucket_of(16_000) == 13 and bucket_of(10) == 3
    # 100,000 tokens queued = 6 full batches + 1 of 1,696: ~12.5 s; within 0.5 x 30 s.
    assert refusal(5, 100_000, 1, 10, rates, 1024, 16_000, 30.0) is None
    reason = refusal(5, 200_000, 1, 10, rates, 1024, 16_000, 30.0)
    assert reason and "would take 25.0 s" in reason
    assert ADMIT_WITHIN * 30.0 < 25.0
    assert "the queue holds 1020 of 1024" in refusal(1020, 10, 5, 10, rates, 1024, 16_000, 30.0)


def test_a_bucket_learns_from_the_batches_it_runs():
    rates = MeasuredRates()
    for _ in range(40):
        rates.observe(4_000, 1.0)
    for _ in range(40):
        rates.observe(4_000, 0.5)  # the machine got faster: the average follows
    assert rates.rate_for(4_000) == pytest.approx(8_000, rel=1e-3)
    assert np.isclose(rates.seconds_for(8_000, 4_000), 1.0, rtol=1e-3)


class AffineEngine:
    """A model double whose forward costs a fixed 20 ms plus 0.5 ms per 1,000 tokens: the shape
    of a real CPU forward, where a one-word batch is mostly fixed cost."""

    task = "classification"

    def run(self, token_ids, segment_ids, table, width):
        import time

        time.sleep(0.02 + 5e-7 * sum(len(t) for t in token_ids))
        return [len(t) for t in token_ids]


def test_seven_tiny_requests_do_not_lock_out_a_large_one():
    """Reliability 5's reproduction through the scheduler: after seven one-word requests, a
    request of 32 x 400 tokens on an idle server is admitted and answered, every time."""
    import asyncio

    from packed_transformers.serving.metrics import ServerMetrics
    from packed_transformers.serving.policies import PolicySettings
    from packed_transformers.serving.scheduler import QueueLimits, Scheduler

    async def scenario():
        scheduler = Scheduler(
            AffineEngine(), PolicySettings("packed", max_length=512, max_batch_tokens=16_384),
            QueueLimits(1024, 0, 0.5), ServerMetrics(),
        )  # fmt: skip
        scheduler.start()
        answers = []
        for _ in range(7):
            answers.append(await scheduler.submit([np.zeros(3)], [None]).future)
        for _ in range(3):  # tiny batches measured ~150 tokens/s: 12,800 tokens "85 s" > 0.25 s
            answers.append(await scheduler.submit([np.zeros(400)] * 32, [None] * 32).future)
        scheduler.stop()
        return answers

    answers = asyncio.run(scenario())
    assert answers[:7] == [[3]] * 7 and answers[7:] == [[400] * 32] * 3


# ----- packing reproducible to the byte, on any machine speed ------------------------------------
def busy_cores(n: int):
    """n processes spinning on the CPU (the load a shared CI machine has)."""
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


@pytest.mark.slow
def test_lp_plans_are_the_same_under_load_and_without():
    """The residual integer program is limited in HiGHS nodes, not seconds: a plan (and so
    the packed bytes) cannot depend on how fast the machine ran that day."""
    from packed_transformers.packing.algorithms.lp import lp_pack
    from packed_transformers.packing.histogram import Histogram

    histogram = Histogram.from_json_file(
        REPO / "packed_transformers" / "packing" / "histograms" / "wikipedia_512.json"
    )
    quiet, _ = lp_pack(histogram, 3)
    spinners = busy_cores(2)  # both cores busy (more would only slow the suite's other worker)
    try:
        loaded, _ = lp_pack(histogram, 3)
    finally:
        for p in spinners:
            p.kill()
    assert sorted(quiet) == sorted(loaded)


@pytest.mark.slow
def test_the_lp_packer_gives_identical_bytes_twice_one_run_under_load(tmp_path):
    from packed_transformers.data.synthetic import write_synthetic_shards
    from packed_transformers.packing.cli import main as packing_main

    from .packing_helpers import P, S, small_counts

    write_synthetic_shards(tmp_path / "in", small_counts(), sequences=3000, rows_per_file=1100, seed=7, p=P)
    args = ["pack", "--input", f"{tmp_path}/in/*.h5", "--max-sequence-length", S, "--max-predictions-per-seq",
            P, "--algorithm", "lp", "--max-sequences-per-pack", 3, "--quiet", "--output"]  # fmt: skip
    assert packing_main([str(a) for a in [*args, tmp_path / "a"]]) == 0
    spinners = busy_cores(4)
    try:
        assert packing_main([str(a) for a in [*args, tmp_path / "b"]]) == 0
    finally:
        for p in spinners:
            p.kill()
    shards = sorted(p.name for p in (tmp_path / "a").glob("part-*.h5"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "b").glob("part-*.h5"))
    for shard in shards:
        assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()


# ----- 10. an API key, and Host / Origin checks against DNS rebinding ------------------------------
def test_access_rules_as_pure_decisions():
    from packed_transformers.serving.access import AccessRules, refusal

    local = AccessRules.for_bind("127.0.0.1", api_key="s3cret")
    ok = {"host": "127.0.0.1:8080", "authorization": "Bearer s3cret"}
    assert refusal(local, "POST", "/predict", ok) is None
    assert refusal(local, "POST", "/predict", {**ok, "host": "localhost:8080"}) is None
    assert refusal(local, "POST", "/predict", {**ok, "host": "[::1]:8080"}) is None
    assert refusal(local, "POST", "/predict", {**ok, "authorization": "Bearer wrong"})[0] == 401
    assert refusal(local, "POST", "/predict", {"host": "127.0.0.1"})[0] == 401
    assert refusal(local, "GET", "/metrics", {"host": "127.0.0.1"})[0] == 401
    assert refusal(local, "GET", "/health", {"host": "127.0.0.1"}) is None  # probes carry no key
    assert refusal(local, "POST", "/predict", {**ok, "host": "evil.example:8080"})[0] == 421
    assert refusal(local, "POST", "/predict", {**ok, "origin": "http://evil.example"})[0] == 403
    assert refusal(local, "POST", "/predict", {**ok, "origin": "http://localhost:3000"}) is None
    everywhere = AccessRules.for_bind("0.0.0.0")
    assert refusal(everywhere, "POST", "/predict", {"host": "my-server.internal"}) is None
    named = AccessRules.for_bind("0.0.0.0", allowed_hosts=["my-server.internal"])
    assert refusal(named, "POST", "/predict", {"host": "other"})[0] == 421


@pytest.mark.slow
def test_a_real_server_checks_the_key_and_refuses_a_foreign_host(tmp_path_factory):
    import threading
    import time

    import httpx
    import uvicorn

    from packed_transformers.serving.access import AccessRules
    from packed_transformers.serving.api import RequestLimits
    from packed_transformers.serving.app import create_app
    from packed_transformers.serving.engines import load_engine
    from packed_transformers.serving.policies import PolicySettings
    from packed_transformers.serving.scheduler import QueueLimits

    from .servers import free_port

    engine = load_engine(tiny_hub_classifier(tmp_path_factory.mktemp("access") / "m"))
    port = free_port()
    app = create_app(engine, PolicySettings("packed", max_length=engine.max_length), QueueLimits(), RequestLimits(),
                     access=AccessRules.for_bind("127.0.0.1", api_key="s3cret"))  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        body = {"inputs": "a text"}
        assert httpx.post(url + "/predict", json=body).status_code == 401
        keyed = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url + "/predict", json=body, headers=keyed).status_code == 200
        # a web page's text/plain POST after DNS rebinding: its own Host and Origin
        foreign = {**keyed, "Host": "attacker.example:8080", "Origin": "http://attacker.example:8080",
                   "Content-Type": "text/plain"}  # fmt: skip
        refused = httpx.post(url + "/predict", content=b'{"inputs": "a text"}', headers=foreign)
        assert refused.status_code == 421 and "attacker.example" in refused.json()["error"]
        assert (
            httpx.post(
                url + "/predict", json=body, headers={**keyed, "Origin": "http://evil.test"}
            ).status_code
            == 403
        )
        metrics = httpx.get(url + "/metrics", headers=keyed).text
        assert 'packed_requests_total{status="401"} 1.0' in metrics
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_pickled_weights_are_refused_in_one_line_everywhere(tmp_path):
    import json

    import torch

    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    torch.save({"weight": torch.zeros(2)}, folder / "pytorch_model.bin")
    texts = tmp_path / "t.jsonl"
    texts.write_text('{"text": "a"}\n')
    for argv in (
        [
            "packed_transformers.finetune.embed",
            "--model",
            folder,
            "--pooling",
            "mean",
            "--input",
            texts,
            "--output",
            tmp_path / "e.npy",
        ],
        ["serving", "--model", folder, "--pooling", "mean", "--port", "1"],
    ):
        assert "pytorch_model.bin (a pickle, which is never loaded here)" in one_line_error(run_module(*argv))


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_embed_refuses_a_pipe_and_an_empty_text_in_one_line(tmp_path):
    from packed_transformers.data.assets import model_dir

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    line = one_line_error(run_module("packed_transformers.finetune.embed", "--model", model_dir(), "--input", fifo,
                                     "--output", tmp_path / "e.npy"))  # fmt: skip
    assert "not a regular file" in line and "save it to a file first" in line
    texts = tmp_path / "t.jsonl"
    texts.write_text('{"text": "fine"}\n{"text": "   "}\n')
    line = one_line_error(run_module("packed_transformers.finetune.embed", "--model", model_dir(), "--input", texts,
                                     "--output", tmp_path / "e.npy"))  # fmt: skip
    assert line == f"error: {texts}:2: field 'text' is empty"
    assert not (tmp_path / "e.npy").exists()


@pytest.mark.slow  # a whole command in a fresh interpreter
def test_predict_reads_a_pipe_once(tmp_path):
    import json
    import threading

    from .folder_helpers import TEXTS

    folder = tiny_hub_classifier(tmp_path / "m")
    records = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:5])
    regular = tmp_path / "in.jsonl"
    regular.write_text(records)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(records))
    writer.start()
    piped = run_module(
        "packed_transformers.finetune.predict",
        "--model",
        folder,
        "--input",
        fifo,
        "--output",
        tmp_path / "p.jsonl",
    )
    writer.join(10)
    assert piped.returncode == 0, piped.stderr
    direct = run_module(
        "packed_transformers.finetune.predict",
        "--model",
        folder,
        "--input",
        regular,
        "--output",
        tmp_path / "r.jsonl",
    )
    assert direct.returncode == 0, direct.stderr
    assert (tmp_path / "p.jsonl").read_text() == (tmp_path / "r.jsonl").read_text()
