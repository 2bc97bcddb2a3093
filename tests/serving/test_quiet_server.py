"""QuietServer: uvicorn's server whose idle event loop wakes once a second, and still stops at once."""

from __future__ import annotations

import email.utils
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import free_port

from lightinfer.entrypoints import quiet_server
from lightinfer.entrypoints.http_limits import uvicorn_config
from lightinfer.entrypoints.quiet_server import QuietServer


async def _app(scope: dict, receive: object, send: object) -> None:  # the smallest ASGI app: 200 "ok"
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _Counted(QuietServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


@pytest.fixture
def served() -> Iterator[tuple[_Counted, threading.Thread, str]]:
    port = free_port()
    server = _Counted(uvicorn_config(_app, "127.0.0.1", port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield server, thread, f"http://127.0.0.1:{port}/"
    server.request_exit()
    thread.join(10)


def test_an_idle_server_ticks_once_a_second_and_keeps_its_date_header(served) -> None:
    server, _, url = served
    before = server.ticks
    time.sleep(2.5)
    assert 1 <= server.ticks - before <= 4  # uvicorn's own loop: ~25 in 2.5 s
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.read() == b"ok"
        date = email.utils.parsedate_to_datetime(reply.headers["date"]).timestamp()
    assert abs(date - time.time()) <= 2.0


@pytest.mark.parametrize("how", ["request_exit", "signal"])
def test_an_exit_wakes_the_loop_at_once(served, monkeypatch, how) -> None:
    server, thread, _ = served
    monkeypatch.setattr(quiet_server, "TICK_S", 60.0)  # a wait the exit must cut short
    time.sleep(1.2)  # the loop is now in a wait of TICK_S
    if how == "signal":
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's handler calls on the main thread
    else:
        server.request_exit()
    thread.join(10)
    assert not thread.is_alive()
