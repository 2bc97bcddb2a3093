"""uvicorn's server, with a main loop that wakes once a second instead of ten times.

``uvicorn.Server.main_loop`` sleeps 100 ms between its ticks. A tick refreshes the ``Date`` header (every tenth
tick, so once a second) and checks whether to exit. An idle ``lightinfer serve`` thus woke its event loop ten
times a second for nothing: about a third of its idle wake-ups with the chat UI's polls, and every one of them
without it (``bench/serving/idle_cpu.py``; issue 21 asks for an idle server below 1% of a core). :class:`QuietServer`
ticks once a second and refreshes the header on every tick. An exit signal (Ctrl-C, SIGTERM) wakes the loop at
once, so the server stops as quickly as before. ``limit_max_requests`` and ``callback_notify`` are checked once a
second, where uvicorn checks them ten times. lightinfer uses neither.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn

TICK_S = 1.0  # the Date header has one-second resolution: one tick a second keeps it exact


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` whose main loop ticks every :data:`TICK_S` seconds and wakes early on an exit signal."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # on_tick refreshes the headers when counter % 10 == 0
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._wake_up()

    def request_exit(self) -> None:
        """Stop serving, as a signal would (graceful shutdown); callable from any thread."""
        self.should_exit = True
        self._wake_up()

    def _wake_up(self) -> None:
        # A signal handler runs on the main thread between bytecodes, maybe inside the loop's own code, and
        # request_exit may come from another thread: call_soon_threadsafe is safe from both and wakes the selector.
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)
