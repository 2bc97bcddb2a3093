"""A ``lightinfer serve`` child process for the start-up and idle benchmarks: spawn it, wait for its first
answered request, read its CPU time and memory from ``/proc``.

Used by ``bench/startup.py`` and ``bench/idle_cpu.py``; any Python whose environment has lightinfer (this
checkout's ``.venv``, or another checkout's, for a before/after in one run) can be the one that serves.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (or one of its threads) so far, in seconds."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, keyed ``"<tid> <name>"``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[f"{task.name} {name}"] = cpu_seconds(pid, int(task.name))
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return out


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


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
        body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 1}).encode()
        deadline = self.t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n" + self.tail())
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    if resp.status == 200:
                        json.loads(resp.read())
                        return time.perf_counter() - self.t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no answer within {timeout:.0f} s:\n" + self.tail())

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


def machine_load() -> str:
    """A one-line note on how busy the machine is (load average against its cores)."""
    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    busy = load > 0.5 * cores
    return (f"load average {load:.1f} on {cores} cores at the start: "
            + ("a busy machine, wall times are inflated (CPU seconds less so)" if busy else "an idle machine"))
