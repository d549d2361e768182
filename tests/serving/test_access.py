"""Who may call the server: the API key and the allowed hosts, as pure decisions and on a real
server (an empty key refused at start, loopback names kept for loopback clients)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..conftest import REPO
from ..folder_helpers import one_line_error, run_module, tiny_hub_classifier  # noqa: F401


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

    from ..servers import free_port

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


# ----- 7, 8. the server's key and its own machine ---------------------------------------------------
@pytest.mark.parametrize("how", ["flag", "environment", "blank"])
def test_an_empty_api_key_is_refused_at_start(tmp_path, how):
    env = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    argv = [
        sys.executable,
        "-m",
        "packed_transformers.serving",
        "--model",
        str(tmp_path),
        "--port",
        "1",
    ]  # any folder: refused first
    if how == "flag":
        argv += ["--api-key", ""]
    elif how == "environment":
        env["API_KEY"] = ""
    else:
        argv += ["--api-key", "   "]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert "an empty key would leave the server without authentication" in one_line_error(done)


def test_loopback_clients_keep_loopback_names_under_allowed_hosts():
    from packed_transformers.serving.access import AccessRules, refusal

    named = AccessRules.for_bind("0.0.0.0", allowed_hosts=["api.example.com"])
    assert refusal(named, "GET", "/ready", {"host": "localhost:8080"}, client="127.0.0.1") is None
    assert refusal(named, "GET", "/ready", {"host": "127.0.0.1:8080"}, client="::ffff:127.0.0.1") is None
    assert refusal(named, "POST", "/predict", {"host": "api.example.com"}, client="10.1.2.3") is None
    # a rebound web page names its own domain, loopback client or not; others may not say localhost
    assert refusal(named, "POST", "/predict", {"host": "evil.example"}, client="127.0.0.1")[0] == 421
    assert refusal(named, "GET", "/ready", {"host": "localhost"}, client="10.1.2.3")[0] == 421
    bound = AccessRules.for_bind("192.168.1.5", allowed_hosts=["api.example.com"])
    assert refusal(bound, "GET", "/ready", {"host": "192.168.1.5:80"}, client="10.1.2.3") is None
    assert refusal(bound, "GET", "/ready", {"host": "localhost"}, client="127.0.0.1") is None
