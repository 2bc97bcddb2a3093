"""CPU used by an idle ``lightinfer serve``: after its first answered request, how much of a core it takes while
nobody calls it, in total and per thread (so a thread that wakes up for nothing is named).

    .venv/bin/python -m bench.serving.idle_cpu [--seconds 30] [--compare OTHER/python]

Reads ``/proc/<pid>/stat`` and ``/proc/<pid>/task/*/stat`` at the start and the end of the idle window
(utime + stime, in clock ticks), so the measurement itself never wakes the server. With ``--compare``
the other interpreter's lightinfer is measured the same way, one after the other. Writes
``bench/results/idle_cpu.json``. Target (issue 21): below 1% of one core.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common.machine import machine_load
from bench.common.results import RESULTS, utc_now, write_json
from bench.common.serve_process import ServeProcess


def measure(python: str, model: str, seconds: float, settle: float, extra: list[str]) -> dict[str, object]:
    """Start a server, answer one request, let it settle, then measure ``seconds`` of idleness."""
    server = ServeProcess(python, model, extra)
    server.start()
    try:
        server.first_answer()
        time.sleep(settle)  # the first request's stream and the UI's background start-up work finish
        total0, threads0, t0 = server.cpu_seconds(), server.thread_cpu(), time.perf_counter()
        time.sleep(seconds)
        total1, threads1, elapsed = server.cpu_seconds(), server.thread_cpu(), time.perf_counter() - t0
        busy = {name: round(100 * (threads1[name] - threads0.get(name, 0.0)) / elapsed, 2) for name in threads1}
        return {"percent_of_a_core": round(100 * (total1 - total0) / elapsed, 2), "seconds": round(elapsed, 1),
                "threads": len(threads1),
                "busiest_threads_percent": dict(sorted(busy.items(), key=lambda kv: -kv[1])[:5])}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of the idle window")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds to wait after the first answer")
    ap.add_argument("--no-ui", action="store_true")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--compare", default=None, metavar="PYTHON", help="also measure another interpreter's lightinfer")
    ap.add_argument("--out", type=Path, default=RESULTS / "idle_cpu.json")
    args = ap.parse_args(argv)
    extra = ["--no-ui"] if args.no_ui else []
    pythons = {"this": args.python} | ({"compare": args.compare} if args.compare else {})
    result: dict[str, object] = {"date": utc_now(), "model": args.model,
                                 "ui": not args.no_ui, "conditions": machine_load(), "target_percent": 1.0}
    for name, python in pythons.items():
        result[name] = measure(python, args.model, args.seconds, args.settle, extra)
        print(f"[idle_cpu] {name}: {result[name]}", flush=True)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
