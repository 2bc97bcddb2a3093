"""The one client that drives every server: ``vllm bench serve`` from the vLLM venv, against /v1/completions.

Random prompts of ``input_len`` tokens (drawn with ``seed`` from the HF folder's tokenizer, so the
same prompts for every server), ``output_len`` output tokens with ``--ignore-eos``, ``num_prompts``
requests at most ``concurrency`` at a time. vLLM's client writes its result as JSON; :func:`summarize`
keeps the figures the tables show.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common.servers import SERVED_MODEL_NAME

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Load:
    """One measurement: ``num_prompts`` requests, at most ``concurrency`` in flight."""

    concurrency: int
    num_prompts: int


def bench_serve_argv(vllm: Path, tokenizer: Path, port: int, load: Load, input_len: int, output_len: int,
                     seed: int, result_dir: Path, result_name: str) -> list[str]:
    """The ``vllm bench serve`` command line of one measurement."""
    return [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", SERVED_MODEL_NAME, "--served-model-name", SERVED_MODEL_NAME,
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0", "--num-prompts",
            str(load.num_prompts), "--max-concurrency", str(load.concurrency), "--request-rate", "inf",
            "--ignore-eos", "--seed", str(seed), "--percentile-metrics", ",".join(METRICS),
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", result_name]


def run_bench_serve(argv: list[str], log_path: Path, result_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run the client, its output appended to ``log_path``; returns its result JSON.

    Raises RuntimeError naming the log when it fails or writes no result.
    """
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(log_path, "ab") as log:
        log.write(("\n$ " + " ".join(argv) + "\n").encode())
        log.flush()
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vllm bench serve ran past {timeout_s:.0f} s; see {log_path}") from None
    if rc != 0 or not result_path.is_file():
        raise RuntimeError(f"vllm bench serve failed (exit {rc}); see {log_path}")
    return json.loads(result_path.read_text())


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The figures kept from one ``vllm bench serve`` result (times in ms, throughput in tokens/s).

    ``failed`` counts requests that errored or were cut (llama-server resets a slot whose
    context is full); their tokens are not in ``output_tok_s``.
    """
    out: dict[str, Any] = {
        "completed": raw.get("completed"),
        "failed": raw.get("failed", raw.get("num_prompts", 0) - raw.get("completed", 0)),
        "duration_s": raw.get("duration"),
        "output_tokens": raw.get("total_output_tokens"),
        "output_tok_s": raw.get("output_throughput"),
        "request_per_s": raw.get("request_throughput"),
    }
    for metric in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "p99"):
            out[f"{stat}_{metric}_ms"] = raw.get(f"{stat}_{metric}_ms")
    errors = [e for e in raw.get("errors", []) if e]
    if errors:
        out["errors"] = sorted(set(errors))[:5]
    return out
