"""The server against a hostile client: real uvicorn on 127.0.0.1, raw sockets where an HTTP
library would be too polite (partial bodies, lies in Content-Length, disconnects), bounded in
count and time. Every case ends in a 4xx or a clean answer, never a 500, and well-formed
requests keep being answered meanwhile. (Malformed JSON, wrong types, oversized texts and
batches are tests/serving/test_serve.py's; embeddings' in tests/serving/test_serve_embeddings.py; /qa's in
tests/finetune/test_qa_run.py.)
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from packed_transformers.serving.api import RequestLimits
from packed_transformers.serving.engines import load_engine
from packed_transformers.serving.scheduler import QueueLimits

from ..conftest import REPO
from ..servers import Server, free_port, signal_under_load, wait_ready

pytestmark = pytest.mark.slow

PREDICT = b'{"inputs": [["the market rallied"], ["the team won the cup"]]}'


def raw_request(port: int, head: str, body: bytes = b"") -> socket.socket:
    """A connected socket that has sent `head` (request line and headers, no blank line)
    and `body` as they are, and nothing more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    return sock


def status_of(sock: socket.socket) -> int:
    """The status code of the first response on `sock` (reads until the status line)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", data)
    assert match, data[:200]
    return int(match.group(1))


def counts(url: str) -> dict[str, int]:
    """packed_requests_total by status, from /metrics."""
    text = httpx.get(url + "/metrics").text
    return {
        m[0]: int(float(m[1])) for m in re.findall(r'packed_requests_total\{status="(\d+)"\} (\S+)', text)
    }


def wait_until(condition, seconds: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.02)


def test_slow_clients_with_partial_bodies_do_not_stall_others_and_are_timed_out(trained):
    limits = RequestLimits(body_timeout_s=4.0)  # a stall behind the slow clients would last this long
    with Server(trained / "run" / "model", limits=limits) as server:
        head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(PREDICT)}"
        slow = [raw_request(server.port, head, PREDICT[:10]) for _ in range(4)]  # and then nothing
        started = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=10) as client:
            answered = [client.post("/predict", content=PREDICT).status_code for _ in range(20)]
        served_in = time.monotonic() - started
        assert answered == [200] * 20
        assert served_in < limits.body_timeout_s, served_in  # not waiting behind the slow ones
        assert [status_of(s) for s in slow] == [408] * 4  # each refused at its body timeout
        for s in slow:
            s.close()
        assert counts(server.url) == {"200": 20, "408": 4}


class GatedEngine:
    """The real engine, whose forward waits for the test to open the gate (so requests can
    be made to queue behind it) and which counts the sequences it runs."""

    def __init__(self, engine):
        self.engine, self.gate, self.entered, self.sequences_run = (
            engine,
            threading.Event(),
            threading.Event(),
            0,
        )

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, token_ids, *args):
        self.entered.set()
        self.gate.wait(30)
        self.sequences_run += len(token_ids)
        return self.engine.run(token_ids, *args)


def test_a_client_that_disconnects_takes_its_queued_work_and_tokens_with_it(trained):
    engine = GatedEngine(load_engine(trained / "run" / "model"))
    with Server(None, engine=engine) as server:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(
                httpx.post, server.url + "/predict", json={"inputs": "the market"}, timeout=30
            )
            assert engine.entered.wait(10)  # the worker is busy with it, behind the gate
            body = b'{"inputs": [' + b", ".join([b'["the team won the cup again"]'] * 8) + b"]}"
            leaving = raw_request(
                server.port, f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}", body
            )
            ready = lambda: httpx.get(server.url + "/ready").json()  # noqa: E731
            wait_until(lambda: ready()["queued"] == 8, what="the 8 sequences queued")
            assert ready()["queued_tokens"] > 0
            leaving.close()
            # withdrawn at once, while the worker is still blocked: nothing runs for nobody
            wait_until(lambda: ready() == {"ready": True, "queued": 0, "queued_tokens": 0}, what="withdrawn")
            engine.gate.set()
            assert first.result().status_code == 200
        assert engine.sequences_run == 1
        assert counts(server.url) == {"200": 1, "499": 1}
        assert "packed_queue_tokens 0.0" in httpx.get(server.url + "/metrics").text


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole(trained):
    limits = RequestLimits(max_body_bytes=64 << 10)
    with Server(trained / "run" / "model", limits=limits) as server:
        # a declared length over the limit: refused after the headers, 1 KiB of 50 MB sent
        declared = raw_request(
            server.port, "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000", b"x" * 1024
        )
        assert status_of(declared) == 413
        declared.close()
        # chunked, no length: refused once past the limit, while the client has more to send
        chunked = raw_request(server.port, "POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked")
        chunk = b"x" * (16 << 10)
        for _ in range(5):  # 80 KiB, and the final empty chunk never sent
            chunked.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert status_of(chunked) == 413
        chunked.close()
        assert httpx.post(server.url + "/predict", content=PREDICT).status_code == 200
        assert counts(server.url) == {"200": 1, "413": 2}


def test_a_request_with_more_sequences_than_the_queue_holds_is_413_not_429(trained):
    with Server(trained / "run" / "model", queue=QueueLimits(max_queue_sequences=4)) as server:
        response = httpx.post(server.url + "/predict", json={"inputs": [["a text"]] * 5})
        assert response.status_code == 413, response.text
        assert "the queue holds at most 4" in response.json()["error"]


def start(model, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "packed_transformers.serving", "--model", str(model), "--port", str(port), "--max-queue", "256",
         "--max-body-bytes", "65536"],
        cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    if wait_ready(f"http://127.0.0.1:{port}"):
        return server
    server.kill()
    raise RuntimeError(f"the server did not start: {server.stderr.read()}")


# What a hostile loop sends, small requests of every kind: (body, the status it must get).
MIXED = [
    (PREDICT, 200),
    (b'{"inputs": "one text"}', 200),
    (b'{"inputs": ', 422),  # not JSON
    (b'{"inputs": "\\ud800x"}', 422),  # a lone surrogate
    (b'{"inputs": []}', 422),
    (b'{"inputs": [["a"]], "truncate": "yes"}', 422),
    (b'{"inputs": "' + b"word " * 200 + b'"}', 413),  # too long for the model, no truncate
    # deep but valid JSON: parsed, then its unknown field refused (any field /predict does not
    # take is, since issue 84)
    (b'{"inputs": [["a"]], "extra": ' + b"[" * 100 + b"]" * 100 + b"}", 422),
    (b'{"inputs": "a", "truncate": ' + b"9" * 5000 + b"}", 422),  # past Python's digit limit (was 500)
    (b'{"inputs": ' + b"[" * 20000 + b"]" * 20000 + b"}", 422),  # too deep for Python's parser (was 500)
    (b'{"inputs": "a", "inputs": ["b"]}', 422),  # a duplicate key (json.loads would keep the last)
]


def test_thousands_of_hostile_requests_leave_rss_bounded_and_sigkill_then_restart_serves(trained):
    model, port = trained / "run" / "model", free_port()
    url = f"http://127.0.0.1:{port}"
    server = start(model, port)
    try:

        def loop(n: int) -> list[tuple[int, int]]:
            with httpx.Client(base_url=url, timeout=30) as client:
                got = []
                for i in range(n):
                    body, expected = MIXED[i % len(MIXED)]
                    got.append((client.post("/predict", content=body).status_code, expected))
                return got

        def hammer(n_per_thread: int) -> list:
            with ThreadPoolExecutor(4) as pool:
                return [pair for part in pool.map(loop, [n_per_thread] * 4) for pair in part]

        warm = hammer(50)  # 200 requests: the allocator's steady state
        rss_before = psutil.Process(server.pid).memory_info().rss
        measured = hammer(500)  # 2,000 requests
        rss_after = psutil.Process(server.pid).memory_info().rss
        for got, expected in warm + measured:
            assert got == expected or (got == 429 and expected == 200), (got, expected)
        grown_mib = (rss_after - rss_before) / 2**20
        print(f"server RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB over 2,000 requests")
        assert grown_mib < 40, grown_mib

        # SIGKILL under load: clients get an answer or a transport error, never a hang
        results = signal_under_load(
            server, url, PREDICT, signal.SIGKILL, requests=32, threads=8, after_s=0.2, timeout=30
        )
        assert server.wait(30) == -signal.SIGKILL
        assert set(results) <= {200, 429, "ConnectError", "ReadError", "RemoteProtocolError"}, results
        log = server.stderr.read()
        server = start(model, port)  # the same port at once: nothing left behind to clean up
        assert httpx.post(url + "/predict", content=PREDICT).status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        log += server.stderr.read()
    assert "Traceback" not in log, log[-3000:]
    assert "'500'" not in log
