"""Connection limits of the HTTP server: no connection is held open by a client that sends nothing.

uvicorn closes a keep-alive connection that stays idle *between* requests (``timeout_keep_alive``), but a
new connection that never sends a byte, one that sends its headers a byte at a time (slowloris), or a
request whose body stops half-way stay open for ever, each holding a socket and a file descriptor. So
the HTTP protocol here is uvicorn's h11 protocol with two deadlines:

* **headers**: a request's headers must be complete within ``timeout_header`` seconds of the connection's
  start (or of its first byte on a reused keep-alive connection); a connection that sends nothing is
  closed after the same time;
* **body**: a request body that makes no progress for ``timeout_body`` seconds is dropped (the route sees
  a client disconnect).

And ``limit_concurrency`` bounds the connections and requests served at once: beyond it uvicorn answers
HTTP 503 at once instead of letting file descriptors run out.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPLimits:
    """The server's connection limits (``lightinfer serve`` flags of the same names).

    Attributes:
        timeout_keep_alive: seconds an idle keep-alive connection stays open between requests.
        timeout_header: seconds a connection has to send a request's complete headers.
        timeout_body: seconds a request body may make no progress before the request is dropped.
        limit_concurrency: most connections and requests at once; beyond it, HTTP 503.
    """

    timeout_keep_alive: float = 5.0
    timeout_header: float = 10.0
    timeout_body: float = 30.0
    limit_concurrency: int = 512

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "timeout_header", "timeout_body"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got "
                                 f"{getattr(self, name)}")
        if self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body deadlines of :class:`HTTPLimits` (module docstring)."""

    timeout_header: float = HTTPLimits.timeout_header
    timeout_body: float = HTTPLimits.timeout_body

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm(self.timeout_header, "sent no complete request headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # still reading headers: one deadline from the first byte, never extended
            if self._deadline is None:
                self._arm(self.timeout_header, "sent no complete request headers")
        elif state is h11.SEND_BODY:  # every chunk of the body resets the idle timer
            self._arm(self.timeout_body, "stopped sending the request body")
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()  # the keep-alive timer takes over until the next request's first byte
        super().on_response_complete()

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._disarm()  # the websocket protocol takes the connection over
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, why: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire, why, seconds)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, why: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        prefix = f"{self.client[0]}:{self.client[1]} " if self.client else ""
        logger.info("%sclosed: it %s within %g s", prefix, why, seconds)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()  # the route waiting for the body sees a disconnect
        self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, limits: HTTPLimits | None = None, log_level: str = "info",
                   **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` serving ``app`` with ``limits`` (default :class:`HTTPLimits`)."""
    import uvicorn

    limits = limits or HTTPLimits()
    protocol = type("LimitedH11Protocol", (DeadlineH11Protocol,),
                    {"timeout_header": limits.timeout_header, "timeout_body": limits.timeout_body})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=limits.timeout_keep_alive, limit_concurrency=limits.limit_concurrency,
                          **kwargs)
