"""What a server process tree costs (memory, CPU) and whether the machine is idle, read from Linux's /proc.

The serving benchmarks need three things no dependency of the project gives without psutil: the
descendants of a server process (vLLM runs an API process and an engine process), their peak
resident memory, and the CPU time of every other process (llama.cpp's threads spin, so any
other load on a 2-core machine distorts its numbers). All of it is a few /proc reads.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc/<pid>/stat counts CPU time in these ticks


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:  # the process ended between listing and reading
        return None
    return text[text.rfind(")") + 2:].split()


def _comm(pid: int, tid: int | str | None = None) -> str:
    path = f"/proc/{pid}/comm" if tid is None else f"/proc/{pid}/task/{tid}/comm"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"


def all_pids() -> list[int]:
    """Ids of every process visible in /proc."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (children, grandchildren...) that are alive now."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        fields = _stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(pid)  # fields[1] = ppid
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid == root and _stat_fields(pid) is None:
            return []
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of one process so far (seconds), or None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of ``pid``, keyed ``"<tid> <name>"``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        fields = text[text.rfind(")") + 2:].split()
        out[f"{tid} {_comm(pid, tid)}"] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def peak_rss_bytes(pid: int) -> int:
    """The high-water mark of one process's resident memory (VmHWM), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def memory_bytes(pid: int) -> tuple[int, int]:
    """``(rss, pss)`` of one process in bytes; (0, 0) if it is gone.

    RSS counts every page the process maps, so shared libraries are counted once per process of a
    tree; PSS splits shared pages among the processes that map them, so summing it over a tree
    counts each page once. Both are reported because multi-process servers (vLLM) differ a lot.
    """
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    return rss, pss


@dataclass
class TreeMonitor:
    """Samples the memory and CPU time of a process tree on a background thread until ``stop()``.

    ``peak_rss`` / ``peak_pss`` are the largest sums over the tree seen in any one sample (bytes);
    ``cpu_seconds()`` is the tree's CPU time so far, counting processes that already ended. Finding
    the tree means reading every /proc/<pid>/stat (tens of ms on a busy machine), so it is redone
    only every ``rescan_s``; the known processes are sampled every ``interval_s``. The monitor so
    costs about 1-2% of a core, not the 10% a full scan every 0.2 s would take from the server.
    """

    root: int
    interval_s: float = 0.5
    rescan_s: float = 2.0
    peak_rss: int = 0
    peak_pss: int = 0
    _pids: list[int] = field(default_factory=list)
    _last_scan: float = -1e9
    _cpu_by_pid: dict[int, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeMonitor:
        self._thread = threading.Thread(target=self._run, name="tree-monitor", daemon=True)
        self._thread.start()
        return self

    def sample(self, rescan: bool = False) -> None:
        """Take one sample now (also called by the thread); ``rescan`` forces a new look for descendants."""
        now = time.monotonic()
        if rescan or now - self._last_scan >= self.rescan_s:
            self._pids, self._last_scan = process_tree(self.root), now
        rss = pss = 0
        for pid in self._pids:
            r, p = memory_bytes(pid)
            rss, pss = rss + r, pss + p
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self._cpu_by_pid[pid] = cpu
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def cpu_seconds(self) -> float:
        self.sample(rescan=True)
        return sum(self._cpu_by_pid.values())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK  # user..steal, less idle and iowait


def own_cpu_seconds() -> float:
    """CPU seconds of this process plus its reaped children (the client runs, once they have ended)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class OthersMeter:
    """How many cores everything else used during a measurement: the machine's busy time less the
    measured server tree's, this process's and its finished children's (the client's).

    Unlike a look before the measurement, this also sees load that started in the middle of it.
    """

    def __init__(self, monitor: TreeMonitor) -> None:
        self.monitor = monitor
        self.start = (time.monotonic(), machine_busy_seconds(), monitor.cpu_seconds(), own_cpu_seconds())

    def stop(self) -> dict[str, float]:
        """``{"others_cores", "server_cores", "wall_s"}``: cores averaged over the ``wall_s`` since construction."""
        t0, busy0, tree0, own0 = self.start
        wall = max(time.monotonic() - t0, 1e-9)
        tree = self.monitor.cpu_seconds() - tree0
        others = machine_busy_seconds() - busy0 - tree - (own_cpu_seconds() - own0)
        return {"others_cores": round(max(others, 0.0) / wall, 3), "server_cores": round(tree / wall, 3),
                "wall_s": round(wall, 3)}


def busy_processes(window_s: float = 2.0, exclude: set[int] | None = None,
                   threshold: float = 0.05) -> list[dict[str, object]]:
    """Processes that used more than ``threshold`` of one core during the next ``window_s`` seconds.

    Returns ``[{"pid", "name", "cores"}]`` (``cores``: CPU seconds per wall second, 1.0 = one core
    busy), busiest first. ``exclude`` holds pids to ignore (this benchmark and the server it measures).
    """
    exclude = exclude or set()
    before = {pid: cpu_seconds(pid) for pid in all_pids() if pid not in exclude}
    t0 = time.monotonic()
    time.sleep(window_s)
    wall = time.monotonic() - t0
    busy = []
    for pid, start in before.items():
        end = cpu_seconds(pid)
        if start is None or end is None:
            continue
        cores = (end - start) / wall
        if cores > threshold:
            busy.append({"pid": pid, "name": _comm(pid), "cores": round(cores, 3)})
    return sorted(busy, key=lambda p: -float(p["cores"]))


def idle_check(exclude: set[int], window_s: float = 3.0, max_other_cores: float = 0.1) -> dict[str, object]:
    """Whether the machine is idle enough to measure: the CPU that other processes use, and the load average.

    Returns ``{"idle", "load_avg", "busy_processes", "cores_used_by_others"}``. ``idle`` is False when
    processes outside ``exclude`` used more than ``max_other_cores`` cores in total during ``window_s``.
    The load average is recorded but does not decide: it lags by a minute, so it still counts the
    server that this benchmark measured just before.
    """
    busy = busy_processes(window_s, exclude)
    others = round(sum(float(p["cores"]) for p in busy), 3)
    return {"idle": others <= max_other_cores, "load_avg": [round(x, 2) for x in os.getloadavg()],
            "busy_processes": busy[:8], "cores_used_by_others": others}
