"""Speculative decoding against the peers' n-gram speculation: the same chat prompts through each server's
``/v1/chat/completions``, one user, greedy, each server with its speculation off and on, one run.

Servers (one at a time, alone on the machine): ``lightinfer serve`` on the embedded SmolLM2 GGUF, without and
with ``--speculative-config`` (prompt lookup, ``num_speculative_tokens`` ``--k``, n-grams 2-4); llama.cpp's
``llama-server`` on the same GGUF, without and with ``--spec-type ngram-simple --spec-draft-n-max K`` (its
prompt lookup); vLLM's CPU build with ``--speculative-config`` ngram where ``--servers`` names it (its start-up
compiles for minutes). The prompts are ``bench.serving.spec_decode``'s copy-heavy and open-chat sets. Per server
and kind: output tokens (the API's ``usage``) over the wall time of the requests, one after another. Peers come
from ``python -m bench.serving.peer_serving --setup``. Writes ``bench/results/spec_peers.json``.

    .venv/bin/python -m bench.serving.spec_peers [--servers lightinfer,llama.cpp] [--k 4] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import peer_install as install
from bench.common import servers
from bench.common.machine import cpu_name, machine_load
from bench.common.results import ROOT, write_result
from bench.serving.spec_decode import COPY_HEAVY, OPEN_CHAT


def _chat(port: int, prompt: str, max_tokens: int) -> int:
    """One greedy chat completion; returns its output tokens."""
    body = json.dumps({"model": servers.SERVED_MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return int(json.load(resp)["usage"]["completion_tokens"])


def _specs(args: argparse.Namespace) -> list[tuple[servers.ServerSpec, int]]:
    """Each server's spec, off then on per server, with its port."""
    spec_json = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                            "prompt_lookup_min": 2})
    out: list[tuple[servers.ServerSpec, int]] = []
    gguf = install.embedded_gguf()
    for name in args.servers:
        for on in (False, True):
            port = servers.free_port()
            if name == "lightinfer":
                extra = f" --speculative-config '{spec_json}'" if on else ""
                spec = servers.lightinfer_spec(Path(sys.executable).parent / "lightinfer",
                                               "smollm2-135m-instruct" + extra, port)
                spec.label = "lightinfer"
                if on:
                    spec.label += " ngram"
            elif name == "llama.cpp":
                spec = servers.llama_cpp_spec(install.llama_server_path(args.peers_dir), gguf, port, args.threads, 1,
                                              4096)
                if on:
                    spec.argv += ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(args.k)]
                    spec.label += " ngram"
            elif name == "vllm":
                spec = servers.vllm_spec(install.vllm_python(args.peers_dir).parent / "vllm",
                                         install.hf_folder_path(args.peers_dir), port, 4, 4096, 0.2)
                if on:
                    spec.argv += ["--speculative-config", spec_json]
                    spec.label += " ngram"
            else:
                raise SystemExit(f"--servers: unknown {name!r}; choose from lightinfer, llama.cpp, vllm")
            out.append((spec, port))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="lightinfer,llama.cpp")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers-dir", type=Path, default=ROOT / ".peers")
    args = ap.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",")]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
                              "machine": machine_load(), "k": args.k, "max_tokens": args.max_tokens,
                              "client": "/v1/chat/completions, greedy, one request at a time", "servers": {}}
    for spec, port in _specs(args):
        running = servers.start(spec, port, args.peers_dir / "logs")
        try:
            running.wait_ready()
            _chat(port, COPY_HEAVY[0], 16)  # warm
            row: dict[str, Any] = {"argv": spec.argv[1:]}
            for kind, prompts in (("copy-heavy", COPY_HEAVY), ("open chat", OPEN_CHAT)):
                start, tokens = time.perf_counter(), 0
                for p in prompts:
                    tokens += _chat(port, p, args.max_tokens)
                row[kind] = round(tokens / (time.perf_counter() - start), 1)
                row[f"{kind} tokens"] = tokens
            print(spec.label, row, flush=True)
            result["servers"][spec.label] = row
        finally:
            running.stop()
    for label, row in list(result["servers"].items()):
        base = result["servers"].get(label.removesuffix(" ngram"))
        if label.endswith(" ngram") and base:
            row["speedup"] = {k: round(row[k] / base[k], 3) for k in ("copy-heavy", "open chat")}
    path = write_result("spec_peers", result)
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
