"""What a result records about the machine: its CPU, its flags, how busy it was (Linux /proc)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                platform.processor() or platform.machine())


def memory_gib() -> float:
    """Total RAM in GiB (/proc/meminfo), one decimal."""
    kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return round(kib / 2**20, 1)


def machine_load() -> str:
    """A one-line note on how busy the machine is (load average against its cores)."""
    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    busy = load > 0.5 * cores
    return (f"load average {load:.1f} on {cores} cores at the start: "
            + ("a busy machine, wall times are inflated (CPU seconds less so)" if busy else "an idle machine"))
