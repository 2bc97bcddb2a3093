"""What recording a decode step's C ops collects (``cpu_native.recording``; replayed by ``engine/cpu_graph.py``).

Its own module so that the engine can name the type without importing the ops' build machinery.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any


class Recording:
    """The C calls of one recorded forward, in order, and the limits the replay must check itself.

    Attributes:
        calls: ``(op name, arguments)`` per call, the arguments as passed (pointers are ints).
        bounds: name -> the smallest limit any recorded op reported (exclusive for ``positions``, ``slots``,
            ``blocks``; inclusive for ``context``): a replayed step's inputs must stay within them, because
            the ops' own range checks ran only while recording.
        max_context: the longest context a replay may attend to (decode attention's work buffer is sized
            for it).
        thread: the recording thread (other threads call the ops as usual).
        ops: the recording stand-ins for the library's ops (same names and arguments).
    """

    def __init__(self, lib: SimpleNamespace, max_context: int) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.bounds: dict[str, int] = {}
        self.max_context = max_context
        self.thread = threading.get_ident()
        self._checking = 0
        self.ops = SimpleNamespace(**{k: v for k, v in vars(lib).items() if not k.startswith("li_")})
        for name, fn in vars(lib).items():
            if name.startswith("li_"):
                setattr(self.ops, name, self._recorder(name, fn))

    def _recorder(self, name: str, fn: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            fn(*args)
            self.calls.append((name, args))
        return call

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
