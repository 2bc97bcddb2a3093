"""A ``lightinfer serve`` child process for the start-up and idle benchmarks: spawn it, wait for its first
answered request, read its CPU time and memory from ``/proc``.

Any Python whose environment has lightinfer (this checkout's ``.venv``, or another checkout's, for a
before/after in one run) can be the one that serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

from bench.common import procfs
from bench.common.servers import answers, free_port


@dataclass
class ServeProcess:
    """``python -m lightinfer.cli serve MODEL --port P [extra]`` with its output lines timestamped.

    Attributes:
        lines: ``(seconds since spawn, text)`` of every stdout/stderr line so far.
    """

    python: str
    model: str
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    port: int = field(default_factory=free_port)
    lines: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> None:
        cmd = [self.python, "-m", "lightinfer.cli", "serve", self.model, "--port", str(self.port), *self.extra]
        env = {**os.environ, **(self.env or {})}
        self.t0 = time.perf_counter()
        # cwd: not a checkout, or `-m lightinfer.cli` would import the checkout's lightinfer, not the interpreter's
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=tempfile.gettempdir(), start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.t0, line.rstrip()))

    def first_answer(self, timeout: float = 600.0) -> float:
        """Seconds from spawn to the first answered ``/v1/completions`` request (one token).

        Raises:
            RuntimeError: the server exited, or did not answer within ``timeout`` (its last lines attached).
        """
        deadline = self.t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n" + self.tail())
            if answers(self.port, timeout_s=60.0, model=self.model):
                return time.perf_counter() - self.t0
            time.sleep(0.05)
        raise RuntimeError(f"no answer within {timeout:.0f} s:\n" + self.tail())

    def cpu_seconds(self) -> float:
        """The server's CPU seconds (user + system) so far. Raises RuntimeError once it has exited."""
        got = procfs.cpu_seconds(self.proc.pid)
        if got is None:
            raise RuntimeError("the server is gone:\n" + self.tail())
        return got

    def thread_cpu(self) -> dict[str, float]:
        """CPU seconds of each of the server's threads, keyed ``"<tid> <name>"``."""
        return procfs.thread_cpu(self.proc.pid)

    def peak_rss_bytes(self) -> int:
        """The server's resident-memory high-water mark."""
        return procfs.peak_rss_bytes(self.proc.pid)

    def tail(self, n: int = 15) -> str:
        return "\n".join(text for _, text in self.lines[-n:])

    def line_time(self, needle: str) -> float | None:
        """Seconds since spawn of the first output line containing ``needle``."""
        return next((t for t, text in self.lines if needle in text), None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
