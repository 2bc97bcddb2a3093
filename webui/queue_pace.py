"""How often Gradio's queue looks for new chat events: often while the chat UI is in use, rarely otherwise.

Gradio's queue polls for new events every 1 ms and for progress updates every 10 ms, also when nobody uses the
UI: 1,100 wake-ups of the server's event loop a second, 3-10% of a core for an idle server (``bench/serving/idle_cpu.py``).
At 50 ms / 100 ms (Gradio's own values on Windows) an idle server still took 1.0% of a core on 2 idle cores
(2026-12-01). So:

* While the UI is in use the queue polls every :data:`QUEUE_POLL_S` (100 ms): a chat message waits at most that
  long before its event starts, a small part of a CPU reply's time to the first token.
* "In use" means any request to the UI (not to the API) in the last :data:`UI_ACTIVE_S` seconds. A page that is
  open asks for its engine panel every 2 s (``gr.Timer``), and a browser throttles a hidden tab's timers to
  about once a minute, so an open tab keeps it in use.
* Otherwise (an API-only server, or the last tab closed) it polls every :data:`QUEUE_IDLE_POLL_S` (1 s). The
  first event after such a pause may wait up to that long.
* The progress poll only forwards ``gr.Progress`` updates, which this UI does not use (a reply streams through
  its generator): every :data:`PROGRESS_POLL_S`, always.

The API is not affected: its routes never go through Gradio's queue.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

QUEUE_POLL_S = 0.1
QUEUE_IDLE_POLL_S = 1.0
UI_ACTIVE_S = 120.0
PROGRESS_POLL_S = 1.0
API_PREFIXES = ("/v1", "/health", "/metrics", "/stats")  # the API's routes (entrypoints/server.py); the rest is UI


class QueuePace:
    """The poll intervals of one Gradio queue (module docstring). Construct it after ``demo.queue()``; call
    :meth:`touch` on the event loop for each request to the UI."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self._last_touch = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_IDLE_POLL_S)
        queue.progress_update_sleep_when_free = max(getattr(queue, "progress_update_sleep_when_free", 0.0),
                                                    PROGRESS_POLL_S)

    @classmethod
    def of(cls, demo: Any) -> QueuePace | None:
        """The pace of ``demo``'s queue; None where this Gradio has no queue with a poll interval to set."""
        queue = getattr(demo, "_queue", None)
        return cls(queue) if queue is not None and hasattr(queue, "sleep_when_free") else None

    @property
    def active(self) -> bool:
        return self.queue.sleep_when_free <= QUEUE_POLL_S

    def touch(self) -> None:
        """A request to the UI arrived: poll often for the next :data:`UI_ACTIVE_S` seconds."""
        self._last_touch = time.monotonic()
        if self._timer is None:  # one timer at a time, rescheduled when it fires early (see _expire)
            self.queue.sleep_when_free = QUEUE_POLL_S
            self._timer = asyncio.get_running_loop().call_later(UI_ACTIVE_S, self._expire)

    def _expire(self) -> None:
        left = self._last_touch + UI_ACTIVE_S - time.monotonic()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self._expire)
            return
        self._timer = None
        self.queue.sleep_when_free = QUEUE_IDLE_POLL_S


class UIActivity:
    """ASGI middleware that calls ``pace.touch()`` for every HTTP request outside :data:`API_PREFIXES`."""

    def __init__(self, app: ASGIApp, pace: QueuePace) -> None:
        self.app, self.pace = app, pace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("path", "").startswith(API_PREFIXES):
            self.pace.touch()
        await self.app(scope, receive, send)
