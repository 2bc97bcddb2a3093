"""What an engine says while it loads: one line per phase on stderr, and how long each phase took.

Loading a model is a handful of phases (reading the checkpoint's config, the tokenizer, building the
model, reading the weights, preparing them for the CPU GEMM, the KV cache, CUDA graphs); each gets a
``lightinfer: [elapsed] phase`` line when it starts, so a slow load is never silent, and the engine
reports the time of every phase when it is ready (``LLMEngine``'s "engine ready" log line).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator


class LoadProgress:
    """Phase lines and timings of one engine load.

    Args:
        enabled: print the phase lines (stderr); timings are kept either way.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Time the block as phase ``what``, announcing it first when enabled."""
        t0 = time.perf_counter()
        if self.enabled:
            print(f"lightinfer: [{t0 - self.start:5.1f} s] {what}", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t0

    def summary(self) -> str:
        """``"phase 1.2 s, phase 0.3 s, ..."`` in the order the phases ran."""
        return ", ".join(f"{what} {s:.1f} s" for what, s in self.seconds.items())
