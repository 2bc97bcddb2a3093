"""What recording a decode step's C ops collects (``cpu_native.recording``; replayed by ``engine/cpu_graph.py``).

Its own module so that the engine can name the type without importing the ops' build machinery.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class Recording:
    """The C calls of one recorded forward, in order, the limits the replay must check itself, and what the
    ops declined.

    Attributes:
        calls: ``(op name, arguments)`` per call, the arguments as passed (pointers are ints).
        bounds: name -> the smallest limit any recorded op reported (exclusive for ``positions``, ``slots``,
            ``blocks``; inclusive for ``context``): a replayed step's inputs must stay within them, because
            the ops' own range checks ran only while recording.
        declined: ``(op, reason)`` for each call a C op declined (its caller ran torch ops instead, which a
            replay cannot repeat), in order; ``engine/cpu_graph.py`` names the first when it refuses a graph.
        max_context: the longest context a replay may attend to (decode attention's work buffer is sized
            for it).
        thread: the recording thread (other threads call the ops as usual).
    """

    def __init__(self, max_context: int) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.bounds: dict[str, int] = {}
        self.declined: list[tuple[str, str]] = []
        self.max_context = max_context
        self.thread = threading.get_ident()
        self._checking = 0

    def record(self, name: str, args: tuple[Any, ...]) -> None:
        """Append one C call (made already) with its arguments."""
        self.calls.append((name, args))

    def decline(self, op: str, reason: str) -> None:
        """Note that the C op ``op`` did not take a call, and why (its caller runs torch ops instead)."""
        self.declined.append((op, reason))

    def bound(self, name: str, limit: int) -> None:
        """Keep the smallest ``limit`` reported for ``name``."""
        self.bounds[name] = min(self.bounds.get(name, limit), limit)

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """While inside, torch ops belong to an op's range check, not to the recorded computation."""
        self._checking += 1
        try:
            yield
        finally:
            self._checking -= 1

    @property
    def in_check(self) -> bool:
        """Whether an op's range check is running (:meth:`checking`)."""
        return self._checking > 0
