"""No connection is held open by a client that sends nothing (issue 19 item 3: 200 idle or half-sent
connections were held for 60 s): idle, slowloris and stalled-body connections are closed after their
deadline, idle keep-alive connections too, and beyond ``limit_concurrency`` requests get 503."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import LiveServer, fake_engine, start_server

from lightinfer.entrypoints.http_limits import HTTPLimits
from lightinfer.entrypoints.server import build_api_app

LIMITS = HTTPLimits(timeout_keep_alive=0.5, timeout_header=1.0, timeout_body=1.0, limit_concurrency=8)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = fake_engine()
    live = start_server(build_api_app(engine), engine, limits=LIMITS)
    yield live
    live.stop()


def _connect(live: LiveServer) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _closed_after(s: socket.socket, send: list[bytes] = (), every: float = 0.0, limit: float = 8.0) -> float:
    """Send ``send`` pieces ``every`` seconds apart, then read until the server closes; seconds it took."""
    t = time.monotonic()
    for piece in send:
        try:
            s.sendall(piece)
        except OSError:  # closed while sending: that is the answer
            return time.monotonic() - t
        time.sleep(every)
    s.settimeout(limit)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return float("inf")
    except OSError:
        pass
    return time.monotonic() - t


def test_a_connection_that_sends_nothing_is_closed(server: LiveServer) -> None:
    with _connect(server) as s:
        assert 0.8 < _closed_after(s) < 4


def test_headers_sent_a_byte_at_a_time_are_cut_off(server: LiveServer) -> None:
    """Slowloris: each byte well within any per-read timeout, the whole headers never done."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with _connect(server) as s:
        took = _closed_after(s, [request[i:i + 1] for i in range(len(request))], every=0.05)
    assert took < 4  # 1 s deadline from the first byte, not 200 x 0.05 s = 10 s


def test_a_stalled_body_is_dropped(server: LiveServer) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\": ")
    with _connect(server) as s:
        assert _closed_after(s, [head]) < 4


def test_idle_keep_alive_connection_is_closed(server: LiveServer) -> None:
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert b"200 OK" in s.recv(4096)
        assert _closed_after(s) < 3


def test_a_slow_but_steady_body_and_normal_requests_still_work(server: LiveServer) -> None:
    body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 3, "temperature": 0}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
    with _connect(server) as s:
        s.sendall(head)
        for i in range(0, len(body), 20):  # 4 chunks 0.5 s apart: 2 s in all, never 1 s without progress
            time.sleep(0.5)
            s.sendall(body[i:i + 20])
        s.settimeout(10)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and b'"text"' in reply, reply[:300]


def test_beyond_the_connection_limit_requests_get_503(server: LiveServer) -> None:
    held = [_connect(server) for _ in range(LIMITS.limit_concurrency)]
    try:
        r = httpx.get(f"{server.url}/health", timeout=5)
        assert r.status_code == 503
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 200:  # freed as they close
        assert time.monotonic() < deadline
        time.sleep(0.1)
