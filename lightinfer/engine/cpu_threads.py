"""How many threads a CPU engine's steps run on: a fixed count, or (the default) as many as other processes leave free.

A CPU step is a few hundred OpenMP parallel regions (torch's ops and the C ops of ``kernels/native``), and
OpenMP's threads spin at the barrier that ends each one. When another process holds one of the cores, the
thread that lost its core stalls every barrier until the scheduler gives it back, and a token takes many times
longer than on one thread (``docs/cpu_performance.md``, "A machine that other processes keep busy"). In the
automatic mode (``EngineConfig.threads="auto"``, the default) the engine therefore measures, every
:attr:`ContentionPolicy.window_s` seconds at the start of a step, how much CPU time *other* processes took on the
cores this process may use (``/proc/stat`` per core, less this process's own CPU time), and runs its steps on
the cores they leave free::

    others = busy time of our cores (/proc/stat) - our CPU time (all our threads)   over the window, in cores
    drop to   cores - ceil(others - drop_above)     threads when that is fewer than now (at least 1)
    go up to  cores - ceil(others - raise_below)    threads when that is more, hold_s after the last change

No probing is needed to return: on fewer threads the measurement still sees whether the other cores are in use.
A window that spans a time without steps (longer than :attr:`ContentionPolicy.stale_s`) is dropped unread: the
decision is about the cores now, not about what ran while the engine waited for work.
Every process's time counts, niced ones too: beside an engine on all its cores a ``nice 19`` busy loop gets ~1.5%
of a core and is not seen, but on a core the engine has given up it takes all the time, and the engine waits for
it to end before taking the core back. The chosen count is applied with ``torch.set_num_threads`` on the engine thread, which
both torch's ops and the C ops follow (the replayed decode steps of ``cpu_graph.py`` pass it to their calls).

An explicit thread count (``threads=N``, ``--threads N``) or ``OMP_NUM_THREADS`` keeps the count fixed, as does a
system without ``/proc/stat`` (not Linux).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightinfer.config import usable_cores

logger = logging.getLogger("lightinfer")

AUTO = "auto"
# /proc/stat's per-core columns (user nice system idle iowait irq softirq steal guest guest_nice): the busy ones.
# steal is time a hypervisor gave the core to another machine: for the engine's threads, another competitor.
# guest time is already part of user.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class ContentionPolicy:
    """When the automatic mode changes the thread count (module docstring).

    Attributes:
        window_s: the shortest span, in seconds, one decision reads (``/proc/stat`` counts in 10 ms ticks: a
            quarter of a second on 2 cores is 50 of them).
        drop_above: the part of a core, beyond whole cores, that other processes must take for the engine to give
            a thread up (0.3: one busy process, which gets at least 2/3 of a core beside 2 spinning threads,
            is seen; a process waking now and then is not).
        raise_below: the part of a core, beyond whole cores, that they must fall below for a thread to be taken
            back (lower than ``drop_above``: no back and forth at the edge).
        hold_s: seconds after a change before the count may go up again.
        stale_s: a window longer than this (the engine had no step to sample at: an idle server, a pause between
            requests) decides nothing and starts a new one: what other processes did while the engine sat idle,
            such as another engine's steps or a build that has ended, says little about the cores now, and a
            drop decided on it would hold the engine on fewer threads for ``hold_s`` on a free machine.
    """

    window_s: float = 0.25
    drop_above: float = 0.3
    raise_below: float = 0.15
    hold_s: float = 1.0
    stale_s: float = 1.0

    def __post_init__(self) -> None:
        if (self.window_s <= 0 or self.hold_s < 0 or self.stale_s < self.window_s
                or not (0 <= self.raise_below <= self.drop_above < 1)):
            raise ValueError(f"a contention policy needs window_s > 0, hold_s >= 0, stale_s >= window_s and "
                             f"0 <= raise_below <= drop_above < 1, got {self}")


class ThreadController:
    """The automatic mode's decisions, from CPU times it is given (no clock or file of its own: testable).

    Args:
        max_threads: the most threads a step may use (the usable cores).
        cores: the cores ``others_cpu_s`` is measured on.
        policy: the thresholds.
    Attributes:
        threads: the count steps run on now.
        others_cores: the other processes' load of the last decision, in cores (None before the first).
        switches: how many times the count changed.
    """

    def __init__(self, max_threads: int, cores: int, policy: ContentionPolicy | None = None) -> None:
        if max_threads < 1 or cores < 1:
            raise ValueError(f"max_threads and cores must be >= 1, got {max_threads} and {cores}")
        self.max_threads = max_threads
        self.cores = cores
        self.policy = policy or ContentionPolicy()
        self.threads = max_threads
        self.others_cores: float | None = None
        self.switches = 0
        self._since: tuple[float, float, float] | None = None  # (wall, busy, own) at the window's start
        self._changed_at = -math.inf

    def _free(self, others: float, margin: float) -> int:
        taken = max(0, math.ceil(others - margin))
        return max(1, min(self.max_threads, self.cores - taken))

    def observe(self, wall_s: float, busy_cpu_s: float, own_cpu_s: float) -> int:
        """One sample, taken at the start of a step; returns the thread count for that step.

        Args:
            wall_s: a monotonic clock, in seconds.
            busy_cpu_s: the CPU seconds all processes have spent on the measured cores (a running total).
            own_cpu_s: the CPU seconds this process has spent (a running total, all its threads).
        Returns:
            the count to run on: unchanged until ``window_s`` has passed since the window's start, and unchanged
            (a new window begun) when more than ``stale_s`` has.
        """
        if self._since is None:
            self._since = (wall_s, busy_cpu_s, own_cpu_s)
            return self.threads
        wall0, busy0, own0 = self._since
        span = wall_s - wall0
        if span < self.policy.window_s:
            return self.threads
        if span > self.policy.stale_s:
            self._since = (wall_s, busy_cpu_s, own_cpu_s)
            return self.threads
        others = max(0.0, (busy_cpu_s - busy0) - (own_cpu_s - own0)) / span
        self._since = (wall_s, busy_cpu_s, own_cpu_s)
        self.others_cores = others
        target = self.threads
        down = self._free(others, self.policy.drop_above)
        up = self._free(others, self.policy.raise_below)
        if down < self.threads:
            target = down
        elif up > self.threads and wall_s - self._changed_at >= self.policy.hold_s:
            target = up
        if target != self.threads:
            self.threads = target
            self.switches += 1
            self._changed_at = wall_s
        return self.threads


class ProcStatLoad:
    """Busy CPU seconds of some cores from ``/proc/stat``, for :class:`ThreadController`.

    Args:
        cpus: the core numbers to sum (this process's affinity).
        path: the file (a test's copy).
    Attributes:
        cores: how many cores the sums cover: ``len(cpus)``, or every core the file lists when one of ``cpus`` is
            missing from it (a container that renumbers them): then the machine-wide line is summed.
    Raises:
        OSError: the file cannot be read; ValueError: it has no ``cpu`` lines.
    """

    def __init__(self, cpus: set[int], path: str | Path = "/proc/stat") -> None:
        self.path = Path(path)
        self._tick = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        listed = self._lines()
        per_cpu = {int(name[3:]) for name in listed if name != "cpu"}
        if not per_cpu and "cpu" not in listed:
            raise ValueError(f"{self.path} has no cpu lines")
        if cpus and cpus <= per_cpu:
            self._names = [f"cpu{c}" for c in sorted(cpus)]
            self.cores = len(cpus)
        else:
            self._names = ["cpu"]
            self.cores = max(1, len(per_cpu))

    def _lines(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        with open(self.path, "rb") as f:
            for line in f.read().split(b"\n"):
                if not line.startswith(b"cpu"):
                    if out:
                        break  # the cpu lines come first; the interrupt counts after them are long
                    continue
                name, *values = line.split()
                out[name.decode()] = [int(v) for v in values]
        return out

    def busy_seconds(self) -> float:
        """CPU seconds spent busy on the measured cores since boot (user, nice, system, irq, softirq, steal)."""
        lines = self._lines()
        total = 0
        for name in self._names:
            values = lines.get(name, [])
            total += sum(values[i] for i in _BUSY_COLUMNS if i < len(values))
        return total * self._tick


def auto_max_threads(threads: int | str | None) -> int | None:
    """The most threads the automatic mode may use, or None where the count is fixed (an explicit ``threads``, or
    ``OMP_NUM_THREADS``, which torch follows)."""
    if isinstance(threads, int) or "OMP_NUM_THREADS" in os.environ:
        return None
    return usable_cores()


class CpuThreads:
    """A CPU engine's thread count: fixed, or chosen per step by a :class:`ThreadController` (module docstring).

    Call :meth:`for_loading` before the weights are prepared, :meth:`for_steps` once loaded, and
    :meth:`before_step` on the engine thread at the start of every step.

    Args:
        threads: ``EngineConfig.threads``: a count, or ``"auto"`` / None.
        policy: the automatic mode's thresholds.
        load: where the busy CPU seconds come from (default :class:`ProcStatLoad` of this process's cores);
            ``own_cpu`` and ``clock``: this process's CPU seconds and a monotonic clock (for tests).
    """

    def __init__(self, threads: int | str | None, policy: ContentionPolicy | None = None,
                 load: Any = None, own_cpu: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requested = threads
        self.fixed: int | None = threads if isinstance(threads, int) else None
        self.controller: ThreadController | None = None
        self.reason = "threads set" if self.fixed else "OMP_NUM_THREADS set"
        self._own_cpu, self._clock = own_cpu, clock
        self._next_sample = -math.inf
        self._load = load
        max_threads = auto_max_threads(threads)
        if max_threads is None:
            return
        if self._load is None:
            try:
                self._load = ProcStatLoad(set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set())
            except (OSError, ValueError) as err:
                self.reason = f"no per-core CPU times to measure other processes by ({err})"
                self.fixed = max_threads
                return
        self.controller = ThreadController(max_threads, self._load.cores, policy)
        self.reason = "adapting to other processes"

    @property
    def mode(self) -> str:
        """``"auto"`` or ``"fixed"``."""
        return AUTO if self.controller is not None else "fixed"

    @property
    def max_threads(self) -> int:
        """The most threads steps may run on."""
        if self.controller is not None:
            return self.controller.max_threads
        return self.fixed or torch.get_num_threads()

    def for_loading(self) -> None:
        """Loading (the weights' CPU preparation) takes every usable core, or the explicit count where larger;
        with ``OMP_NUM_THREADS`` alone torch already follows that variable."""
        if self.fixed or "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(self.fixed or 1, usable_cores()))

    def for_steps(self) -> None:
        """The steps' count, from the end of loading: the fixed one, or in the automatic mode all usable cores
        until contention is measured."""
        count = self.controller.threads if self.controller is not None else self.fixed
        if count:
            torch.set_num_threads(count)

    def before_step(self) -> None:
        """At the start of a step, on the engine thread: in the automatic mode, a sample every ``window_s`` and
        the count it gives applied (``torch.set_num_threads``, only when it changes)."""
        ctl = self.controller
        if ctl is None:
            return
        now = self._clock()
        if now < self._next_sample:
            return
        before = ctl.threads
        ctl.observe(now, self._load.busy_seconds(), self._own_cpu())
        self._next_sample = now + ctl.policy.window_s
        if ctl.threads != before:
            torch.set_num_threads(ctl.threads)
            logger.debug("lightinfer: other processes take %.2f of %d cores: CPU steps on %d thread(s), were %d",
                         ctl.others_cores or 0.0, ctl.cores, ctl.threads, before)

    def info(self) -> dict[str, Any]:
        """For ``model_info()``: ``mode`` ("auto" / "fixed"), ``threads`` (of the next step), ``max_threads``,
        ``reason``; in the automatic mode also ``others_cores`` (other processes' load at the last
        measurement, in cores; None before it) and ``switches`` (changes so far)."""
        out: dict[str, Any] = {"mode": self.mode, "threads": torch.get_num_threads(),
                               "max_threads": self.max_threads, "reason": self.reason}
        if self.controller is not None:
            out["threads"] = self.controller.threads
            others = self.controller.others_cores
            out["others_cores"] = None if others is None else round(others, 2)
            out["switches"] = self.controller.switches
        return out
