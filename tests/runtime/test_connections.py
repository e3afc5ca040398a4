"""``compress serve``'s guards below the handlers (compress.runtime.connections), through raw
sockets against a real server: stalled clients are cut off, and connections past the cap get a
503 instead of taking the process's files. Found by fuzzing: four kinds of stalled socket stayed
open for good, and 300 idle ones under ``ulimit -n 256`` made accepting fail for everyone."""

from __future__ import annotations

import json
import resource
import socket
import time

import httpx
import pytest

from compress.runtime import connections
from compress.runtime.engine import Runtime
from tests.runtime.test_server import Running, tiny


def runtime_and_tokenizer():
    model, tokenizer = tiny()
    return Runtime(model, max_seq_len=128, compile=False), tokenizer


@pytest.fixture(scope="module")
def quick():
    """A server whose deadlines are short: headers within 0.5 s, body pauses under 0.5 s."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(connections, "BODY_TIMEOUT_S", 0.5)  # read when the app is first called
        running = Running(*runtime_and_tokenizer(), header_timeout=0.5)
        assert httpx.get(running.url + "/health").status_code == 200  # builds the middleware
    yield running
    running.close()


def connect(running) -> socket.socket:
    host, port = running.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a socket timeout fails the test: still open)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("sent", [
    b"",  # connects and says nothing
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never finished
], ids=["nothing", "half-the-headers"])  # fmt: skip
def test_a_connection_without_a_request_in_time_is_closed(quick, sent):
    with connect(quick) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        assert read_all(sock) == b""
        assert time.monotonic() - start < 8


def test_a_kept_alive_connection_gets_the_deadline_again_after_each_response(quick):
    with connect(quick) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b'"ok"' not in first and (chunk := sock.recv(65536)):  # headers, body apart
            first += chunk
        assert first.startswith(b"HTTP/1.1 200") and b'"ok"' in first
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next one stalls
        assert read_all(sock) == b""


@pytest.mark.parametrize("head, body", [
    (b"Content-Length: 100\r\n", b'{"prompt": '),  # shorter than it said
    (b"Transfer-Encoding: chunked\r\n", b'b\r\n{"prompt": \r\n'),  # a chunked body never ending
], ids=["content-length", "chunked"])  # fmt: skip
def test_a_body_that_stops_arriving_is_a_408_and_the_server_goes_on(quick, head, body):
    with connect(quick) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n" + head + b"\r\n" + body)
        reply = read_all(sock)
    status, _, rest = reply.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), reply
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert "the request body stopped arriving" in error["message"] and error["code"] == 408
    stats = quick.stats()
    assert (stats["running"], stats["waiting"], stats["kv_blocks_in_use"]) == (0, 0, 0)
    reply = httpx.post(quick.url + "/v1/completions", timeout=30,
                       json={"prompt": [1, 40], "max_tokens": 2, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_past_the_cap_the_oldest_idle_connection_makes_room_else_a_503():
    """Held idle sockets kept every new client (``/health`` too) at 503: now the oldest
    connection that waits for a request is closed for the new one; only when every connection
    has a request in flight is the new one refused, with a JSON 503, and closed."""
    running = Running(*runtime_and_tokenizer(), max_connections=3)
    held = [connect(running) for _ in range(3)]
    try:
        time.sleep(0.2)  # accepted
        with connect(running) as newest:
            assert read_all(held[0]) == b""  # the oldest idle one was closed
            newest.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert newest.recv(65536).startswith(b"HTTP/1.1 200")
        for sock in held:
            sock.close()
        time.sleep(0.2)
        # three requests in flight (bodies still coming): nothing idle to close
        busy = [connect(running) for _ in range(3)]
        for sock in busy:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
        time.sleep(0.2)
        with connect(running) as extra:
            # its request is read and dropped: closed unread, the socket reset and a client
            # still sending its body got a broken pipe instead of the 503
            extra.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          b"200000\r\n\r\n" + b"x" * 200_000)
            reply = read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert b"retry-after: 1" in reply.lower()
        error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert "3 connections are open already (the bound is 3)" in error["message"]
        for sock in busy:
            sock.close()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)  # their close is seen
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}
    running.close()


@pytest.mark.parametrize("soft, hard, raised, cap", [
    (256, 256, 256, 128),  # what the fuzzing ran under: half for connections
    (1024, 4096, 4096, 1000),  # raised to the hard limit, then MAX_CONNECTIONS
    (10, 10, 10, 8),  # never under 8
    (1024, resource.RLIM_INFINITY, 65535, 1000),
])  # fmt: skip
def test_the_connection_cap_follows_the_open_file_limit(monkeypatch, soft, hard, raised, cap):
    limits = {"now": (soft, hard)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(now=value))
    assert connections.connection_cap() == cap
    assert limits["now"] == (raised, hard)


def test_a_refused_raise_of_the_file_limit_keeps_the_limit(monkeypatch, caplog):
    def refuse(*_):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda _: (64, 4096))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert connections.connection_cap() == 32
    assert "could not raise the open-file limit from 64" in caplog.text
