"""Request heads over their limits and unknown or missing fields: refused (431, 422) while other
clients are answered; the server command takes the head limits."""

from __future__ import annotations

import pytest


# ----- 12. embedding routes: prompt_name on OpenAI's route, unknown fields refused ----------------
def test_embedding_routes_take_prompt_name_and_refuse_unknown_fields():
    from packed_transformers.serving.api import RequestError, RequestLimits, read_request

    limits = RequestLimits()
    request = read_request("openai", {"input": ["a"], "prompt_name": "query"}, limits, dimension=8)
    assert request.options["prompt_name"] == "query"
    assert (
        read_request("embed", {"inputs": "a", "prompt_name": "query"}, limits).options["prompt_name"]
        == "query"
    )
    for route, body in (
        ("openai", {"input": "a", "normalize": True}),
        ("embed", {"inputs": "a", "input": "b"}),
    ):
        with pytest.raises(RequestError) as caught:
            read_request(route, body, limits, dimension=8)
        assert caught.value.status == 422 and "not a field of this route" in str(caught.value)
    with pytest.raises(RequestError, match='field "prompt_name": expected a string'):
        read_request("openai", {"input": "a", "prompt_name": 3}, limits, dimension=8)


# ----- 7. the server bounds request heads in size and time ----------------------------------------
def raw_client(port: int):
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def read_all(sock) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.slow  # a real uvicorn server, clients over loopback, a timeout to wait out
def test_hostile_heads_are_refused_and_other_clients_answered_within_a_second(hub_classifier):
    import threading
    import time

    import httpx

    from packed_transformers.serving.headers import HeadLimits, bounded_protocol

    from ..servers import Server

    limits = HeadLimits(max_bytes=16 * 1024, timeout_s=2.0)
    with Server(hub_classifier, http=bounded_protocol(limits)) as server:
        # 1. one client streaming a 200 MB header: 431 after the limit, never the whole stream
        big = raw_client(server.port)
        answer = {}

        def stream_header():
            big.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            sent = 0
            try:
                while sent < 200 << 20:
                    big.sendall(b"a" * (1 << 16))
                    sent += 1 << 16
            except OSError:
                pass
            answer["sent"] = sent
            answer["reply"] = read_all(big)

        streamer = threading.Thread(target=stream_header)
        streamer.start()
        # 2. 100 clients trickling a head a byte at a time
        tricklers = [raw_client(server.port) for _ in range(100)]
        for sock in tricklers:
            sock.sendall(b"P")
        started = time.monotonic()
        latencies = []
        while time.monotonic() - started < 3.0:
            t0 = time.monotonic()
            reply = httpx.post(server.url + "/predict", json={"inputs": "a small request"}, timeout=10)
            latencies.append(time.monotonic() - t0)
            assert reply.status_code == 200, reply.text
        streamer.join(60)
        assert answer["reply"].startswith(b"HTTP/1.1 431") and answer["sent"] < 200 << 20
        refused = [read_all(sock) for sock in tricklers]  # the deadline has passed: each refused, closed
        assert all(r.startswith(b"HTTP/1.1 408") for r in refused), refused[:2]
        assert max(latencies) < 1.0, latencies
        # a normal client on a kept-alive connection is not timed out between requests
        with httpx.Client(base_url=server.url) as client:
            assert client.post("/predict", json={"inputs": "one"}).status_code == 200
            time.sleep(2.5)
            assert client.post("/predict", json={"inputs": "two"}).status_code == 200


def read_response(sock) -> bytes:
    """One HTTP/1.1 response from a kept-alive connection: its head, then content-length bytes."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, reply
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.slow  # a real uvicorn server
def test_a_head_over_the_limit_is_refused_even_when_it_arrives_in_one_read(hub_classifier):
    """--max-header-bytes 2048: heads of 4 KB and 100 KB sent whole get 431 (they got 200: the
    head was parsed and handed to the app within one read before it was counted); a request
    whose body arrives in the same read as its head, and the next request on that kept-alive
    connection, are answered (a body is not head), also when the blank line ending the head is
    split over two reads (it was refused 431: the second read was counted whole as head)."""
    import json
    import time

    from packed_transformers.serving.headers import HeadLimits, bounded_protocol

    from ..servers import Server

    body = json.dumps(
        {"inputs": "a small request " * 200, "truncate": True}
    ).encode()  # 3.2 KB: over the head limit
    request = (
        b"POST /predict HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    )
    with Server(hub_classifier, http=bounded_protocol(HeadLimits(max_bytes=2048, timeout_s=5.0))) as server:
        for size in (4 << 10, 100 << 10):
            sock = raw_client(server.port)
            sock.sendall(b"POST /predict HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
            assert read_all(sock).startswith(b"HTTP/1.1 431"), size
        sock = raw_client(server.port)
        for _ in range(2):  # one read each: head and body together; then again on the same connection
            sock.sendall(request % (len(body), body))
            reply = read_response(sock)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        # the blank line that ends the head split over two reads, the body after it in the second
        whole = request % (len(body), body)
        cut = whole.index(b"\r\n\r\n") + 3
        sock.sendall(whole[:cut])
        time.sleep(0.2)  # two reads on the server's side
        sock.sendall(whole[cut:])
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.close()


def test_the_server_command_takes_the_head_limits():
    from packed_transformers.serving import cli

    assert cli.main(["--model", "x", "--max-header-bytes", "0"]) == 2
    assert cli.main(["--model", "x", "--header-timeout-s", "0"]) == 2
