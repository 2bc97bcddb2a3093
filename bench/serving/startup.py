"""Start-up of ``lightinfer serve MODEL``: process start to its first answered request, and where it goes.

    .venv/bin/python -m bench.serving.startup                          # 3 runs of this checkout
    .venv/bin/python -m bench.serving.startup --compare OTHER/python   # interleaved with another lightinfer

Each run spawns ``python -m lightinfer.cli serve MODEL`` on a free port (chat UI included unless
``--no-ui``), posts a one-token ``/v1/completions`` request every 50 ms until one is answered, and records
the wall time to that answer, the server's CPU seconds by then (on a busy shared machine the wall time
is inflated, the CPU time much less), its peak RSS, and when its progress lines appeared (loading,
engine ready, serving). With ``--compare`` the other interpreter's runs alternate with this one's, and
medians of both are reported with their ratio. Writes ``bench/results/startup.json``.
Target (issue 19 item 10 / issue 21): the embedded model answers within 10 s on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.common.machine import machine_load
from bench.common.results import RESULTS, utc_now, write_json
from bench.common.serve_process import ServeProcess

PHASES = {"loading": "loading", "weights": "loading the weights", "engine_ready": "engine ready",
          "serving": "is serving"}


def one_run(python: str, model: str, extra: list[str], env: dict[str, str]) -> dict[str, object]:
    server = ServeProcess(python, model, extra, env)
    server.start()
    try:
        first = server.first_answer()
        record = {"first_answer_s": round(first, 2), "cpu_s": round(server.cpu_seconds(), 2),
                  "peak_rss_mib": round(server.peak_rss_bytes() / 2**20, 1)}
        record |= {f"{name}_s": round(t, 2) if (t := server.line_time(needle)) is not None else None
                   for name, needle in PHASES.items()}
        return record
    finally:
        server.stop()


def summarize(runs: list[dict[str, object]]) -> dict[str, float]:
    keys = [k for k in runs[0] if all(isinstance(r.get(k), (int, float)) for r in runs)]
    return {k: round(statistics.median(float(r[k]) for r in runs), 2) for k in keys}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-ui", action="store_true", help="serve the API only (no Gradio)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose lightinfer is measured")
    ap.add_argument("--compare", default=None, metavar="PYTHON",
                    help="another interpreter with another lightinfer (e.g. the branch point's), run interleaved")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS for the servers (on a busy machine 1 makes CPU seconds a fair figure: no "
                         "OpenMP thread spins waiting for a descheduled one)")
    ap.add_argument("--out", type=Path, default=RESULTS / "startup.json")
    args = ap.parse_args(argv)
    extra = ["--no-ui"] if args.no_ui else []
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    pythons = {"this": args.python} | ({"compare": args.compare} if args.compare else {})
    conditions = machine_load()
    print(f"[startup] {conditions}", flush=True)
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in pythons}
    for i in range(args.repeats):
        for name, python in pythons.items():
            record = one_run(python, args.model, extra, env)
            runs[name].append(record)
            print(f"[startup] run {i + 1} {name}: {record}", flush=True)
    result: dict[str, object] = {
        "date": utc_now(), "model": args.model, "ui": not args.no_ui,
        "threads": args.threads,
        "conditions": conditions, "pythons": pythons, "runs": runs,
        "median": {name: summarize(r) for name, r in runs.items()}}
    if args.compare:
        this, other = result["median"]["this"], result["median"]["compare"]
        result["ratio_this_over_compare"] = {k: round(this[k] / other[k], 3) for k in this
                                             if other.get(k)}
    write_json(args.out, result)
    print(json.dumps(result["median"], indent=1))
    return result


if __name__ == "__main__":
    main()
