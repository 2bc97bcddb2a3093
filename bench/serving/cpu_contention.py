"""A CPU engine's decode steps beside another busy process: the automatic thread count (``threads="auto"``, the
default: fewer threads while other processes hold cores, ``lightinfer/engine/cpu_threads.py``) against a count
fixed at every usable core (what the default was before it).

    .venv/bin/python -m bench.serving.cpu_contention [--rounds 3] [--tokens 32] [--batches 1 4]

One engine per setting, each in its own process, loaded once and warmed up (decode steps recorded). Then,
round by round, each engine generates ``--tokens`` tokens for 1 and for 4 sequences on the machine as it is
("idle") and beside one busy-loop process (``python -c 'while ...: pass'``, started before and stopped after
its measurements, bounded in time), the settings' order alternating by round. A measurement's figure is the
median decode step (prefill left out) in ms; the mean is kept too (it holds the slow steps before the
automatic mode reacts). The summary has the median of the rounds and two ratios: idle, auto against fixed
(target <= 1.05), and beside the busy process, fixed against auto (target >= 10). Each measurement also
records the other processes' load during it (``/proc/stat``, less the engine's and the busy loop's CPU time),
in cores, so that a figure from a machine that was not idle says so. Writes ``bench/results/cpu_contention.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.procfs import cpu_seconds, machine_busy_seconds

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
BUSY_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
# a competitor like a test suite or another model beside the engine: torch's matrix products on every core, whose
# OpenMP threads spin between products as the engine's do
TORCH_LOOP = ("import os, time, torch\ntorch.set_num_threads(len(os.sched_getaffinity(0)))\na = torch.randn(384, 384)\n"
              "end = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    a @ a\n")
COMPETITORS = {"loop": BUSY_LOOP, "torch": TORCH_LOOP}


# ---------------------------------------------------------------- worker (one engine)

def worker(threads: str, model: str, batches: list[int]) -> None:
    """Serve measurement commands (JSON lines on stdin) with one engine; answers are JSON lines on stdout."""
    import torch

    from lightinfer import LLM, SamplingParams

    llm = LLM(model, threads=threads if threads == "auto" else int(threads), max_model_len=1024,
              show_progress=False)
    engine = llm.llm_engine

    def run(batch: int, tokens: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", PROMPT, params)
        steps: list[float] = []
        counts: dict[int, int] = {}
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            n = torch.get_num_threads()
            counts[n] = counts.get(n, 0) + 1
        decode = steps[1:] or steps
        return {"median_ms": 1000 * statistics.median(decode), "mean_ms": 1000 * statistics.fmean(decode),
                "steps": len(steps), "seconds": time.perf_counter() - t0,
                "threads_of_steps": {str(k): v for k, v in sorted(counts.items())}}

    for batch in batches:  # record the decode steps of each size
        run(batch, 8)
    print(json.dumps({"ready": True, "pid": os.getpid(), "cpu_threads": engine.model_info()["cpu_threads"]}),
          flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out = run(cmd["batch"], cmd["tokens"])
        out["cpu_threads"] = engine.model_info()["cpu_threads"]
        print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- parent

def _pids_cpu(pids: list[int]) -> float:
    """CPU seconds of these processes (all their threads) so far; one that has ended counts 0."""
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


class Engine:
    """A worker process with one engine."""

    def __init__(self, setting: str, model: str, batches: list[int]) -> None:
        self.setting = setting
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.serving.cpu_contention", "--worker", setting, "--model", model, "--batches", *map(str, batches)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def ready(self) -> dict[str, Any]:
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.setting} engine's process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def measure(self, batch: int, tokens: int, busy_pid: int | None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        pids = [self.proc.pid] + ([busy_pid] if busy_pid else [])
        cpu0, busy0, t0 = _pids_cpu(pids), machine_busy_seconds(), time.monotonic()
        self.proc.stdin.write(json.dumps({"batch": batch, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._answer()
        span = time.monotonic() - t0
        cpu1, busy1 = _pids_cpu(pids), machine_busy_seconds()
        out["background_cores"] = round(max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / span, 2)
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def controller_cost(calls: int = 20000) -> dict[str, float]:
    """What the automatic mode adds to a step, in microseconds: a call that only reads the clock (most steps),
    and one that reads ``/proc/stat`` and decides (one per window)."""
    from lightinfer.engine.cpu_threads import CpuThreads

    threads = CpuThreads("auto")
    if threads.controller is None:
        return {}
    threads.before_step()
    t = time.perf_counter()
    for _ in range(calls):
        threads.before_step()  # within the window: the clock only
    fast = (time.perf_counter() - t) / calls
    t = time.perf_counter()
    for _ in range(calls // 20):
        threads._next_sample = 0.0  # force a sample
        threads.before_step()
    sample = (time.perf_counter() - t) / (calls // 20)
    return {"us_per_step_without_sample": round(1e6 * fast, 2), "us_per_sample": round(1e6 * sample, 1),
            "samples_per_second": round(1 / threads.controller.policy.window_s, 1)}


def summarize(runs: dict[str, list[dict[str, Any]]], settings: list[str]) -> dict[str, Any]:
    """Median of the rounds per (setting, load, batch), and the two ratios per batch."""
    medians: dict[str, float] = {}
    for key, values in runs.items():
        medians[key] = round(statistics.median(v["median_ms"] for v in values), 2)
    auto, fixed = settings
    ratios: dict[str, float] = {}
    for key, ms in medians.items():
        setting, load, batch = key.split("/")
        if setting != auto:
            continue
        other = medians[f"{fixed}/{load}/{batch}"]
        if load == "idle":
            ratios[f"idle_{batch}_auto_over_fixed"] = round(ms / other, 3)
        else:
            ratios[f"busy_{batch}_fixed_over_auto"] = round(other / ms, 2)
    return {"median_step_ms": medians, "ratios": ratios}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per sequence per measurement")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="sequences per measurement")
    ap.add_argument("--fixed", type=int, default=None,
                    help="the fixed count to compare with (default: the usable cores, the old default)")
    ap.add_argument("--competitor", choices=sorted(COMPETITORS), default="loop",
                    help="the busy process: a one-thread Python loop, or torch's matrix products on every core")
    ap.add_argument("--busy-limit", type=float, default=900.0,
                    help="seconds after which a busy-loop process ends by itself (it is stopped sooner)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_contention.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.model, args.batches)
        return {}
    cores = len(os.sched_getaffinity(0))
    settings = ["auto", str(args.fixed or cores)]
    env_note = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
        "cpu": platform.processor() or platform.machine(), "usable_cores": cores,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "environment": env_note,
        "settings": {"auto": "threads='auto' (the default)", settings[1]: f"threads={settings[1]} (fixed)"},
        "rounds": args.rounds, "tokens": args.tokens, "batches": args.batches,
    }
    try:
        with open("/proc/cpuinfo") as f:
            result["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                                 result["cpu"])
    except OSError:
        pass
    result["controller_cost"] = controller_cost()
    engines = {s: Engine(s, args.model, args.batches) for s in settings}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for s, e in engines.items():
            result.setdefault("engines", {})[s] = e.ready()
        for r in range(args.rounds):
            order = settings if r % 2 == 0 else settings[::-1]
            for load in ("idle", "busy"):
                busy = None
                if load == "busy":
                    busy = subprocess.Popen([sys.executable, "-c",
                                             COMPETITORS[args.competitor].format(seconds=args.busy_limit)])
                    time.sleep(0.5)
                try:
                    for s in order:
                        for batch in args.batches:
                            out = engines[s].measure(batch, args.tokens, busy.pid if busy else None)
                            out["round"] = r
                            runs.setdefault(f"{s}/{load}/{batch}", []).append(out)
                            print(f"round {r} {load:4s} threads={s:4s} batch {batch}: "
                                  f"{out['median_ms']:8.1f} ms/step (mean {out['mean_ms']:.1f}), "
                                  f"steps on threads {out['threads_of_steps']}, "
                                  f"background {out['background_cores']} cores", flush=True)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    finally:
        for e in engines.values():
            e.close()
    result.update(summarize(runs, settings))
    result["runs"] = runs
    result["competitor"] = args.competitor
    result["targets"] = {"idle_auto_over_fixed": "<= 1.05", "busy_fixed_over_auto": ">= 10"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"median_step_ms": result["median_step_ms"], "ratios": result["ratios"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
