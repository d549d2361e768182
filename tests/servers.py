"""A real uvicorn server in a thread (Server), free ports, and waiting for a server to answer.

Shared by several test modules (no test module imports another)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn

from packed_transformers.serving.api import RequestLimits
from packed_transformers.serving.app import create_app
from packed_transformers.serving.engines import load_engine
from packed_transformers.serving.policies import PolicySettings
from packed_transformers.serving.scheduler import QueueLimits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An in-process uvicorn server on a free port, in a thread."""

    def __init__(
        self, folder, policy="packed", queue=None, limits=None, engine=None, http="auto", **settings
    ):
        engine = engine or load_engine(folder)
        policy_settings = PolicySettings(policy, max_length=engine.max_length, **settings)
        self.app = create_app(engine, policy_settings, queue or QueueLimits(), limits or RequestLimits())
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def wait_ready(url: str, seconds: float = 60) -> bool:
    """Poll GET /ready until it answers 200 (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return True
        except httpx.TransportError:
            time.sleep(0.1)
    return False


def signal_under_load(
    server, url, body: bytes, signum, requests: int, threads: int, after_s: float, timeout: float = 60
) -> list:
    """POST `body` to /predict `requests` times from `threads` clients; send `signum` to the
    server process `after_s` seconds in. -> per request, its status code or the name of the
    transport error the client saw."""
    results = []

    def send(_):
        try:
            results.append(httpx.post(url + "/predict", content=body, timeout=timeout).status_code)
        except httpx.TransportError as err:
            results.append(type(err).__name__)

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(send, i) for i in range(requests)]
        time.sleep(after_s)
        server.send_signal(signum)
        for f in futures:
            f.result()
    return results
