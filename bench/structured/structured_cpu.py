"""Constrained decoding on CPU: what a JSON schema costs the engine, measured in one run.

SmolLM2-135M-Instruct (fp32), ``--num-requests`` (32) requests submitted at once, each generating
exactly ``--max-tokens`` tokens so that every workload runs the same steps at the same batch size:

  * ``free``: no constraint (``ignore_eos``);
  * ``schema``: every request constrained by a 20-property JSON schema (``twenty_property_schema``, whose
    instances are longer than ``--max-tokens``: no row finishes early);
  * ``mixed``: half of them constrained, half free;
  * ``schema_overlap``: as ``schema``, with the bitmask filled on a worker thread while the forward runs
    (the engine's default on CUDA; on CPU the forward already uses the cores).

Workloads are interleaved ``--rounds`` times (the machine may be shared: read the ratios, taken from
the medians, not the absolute rates). Targets (issue 17): ``schema`` >= 0.8x ``free`` in tokens/s; the
free requests of ``mixed`` >= 0.95x of ``free`` in per-request decode rate. The engine's mask time per
constrained step (fill, apply, and what the engine thread waited) is reported per workload.

Runs through ``LLM``; the mask times and the overlap switch are the engine's ``StructuredOutputManager``'s
(``llm.llm_engine.structured``: the seam it measures). Writes ``bench/results/structured_cpu.{json,md}``.

    python -m bench.structured.structured_cpu [--num-requests 32] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.results import RESULTS
from bench.structured.cases import twenty_property_schema
from lightinfer import LLM, SamplingParams

PROMPT = "Describe a fictional product as a JSON record with many fields."
WORKLOADS = ("free", "schema", "mixed", "schema_overlap")


def run_workload(llm: LLM, kind: str, num_requests: int, max_tokens: int) -> dict[str, Any]:
    """One batch of ``num_requests`` requests; returns wall time, tokens, and the mask stats of the run."""
    engine = llm.llm_engine
    manager = engine.structured
    manager.overlap = kind == "schema_overlap"
    constrained = {"free": 0, "schema": num_requests, "schema_overlap": num_requests, "mixed": num_requests // 2}[kind]
    spec = {"json": twenty_property_schema()}
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=spec if i < constrained else None) for i in range(num_requests)]
    prompts = [f"{PROMPT} (#{i})" for i in range(num_requests)]
    for p in params:  # compile outside the timed part, as the API does on its preparation thread
        llm.input_processor.check_params(p)
    before = vars(manager.stats).copy()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = vars(manager.stats)
    delta = {k: after[k] - before[k] for k in before}
    steps = max(1, delta["num_steps"])
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    free_tokens = sum(tokens[constrained:])
    if any(o.outputs[0].finish_reason != "length" for o in outs):
        raise RuntimeError(f"{kind}: a request finished early; raise the schema's size or lower --max-tokens")
    return {
        "seconds": seconds, "tokens": sum(tokens), "tokens_per_s": sum(tokens) / seconds,
        "free_requests": num_requests - constrained,
        "free_request_tokens_per_s": (free_tokens / (num_requests - constrained) / seconds)
        if constrained < num_requests else None,
        "constrained_steps": delta["num_steps"],
        "mask_fill_ms_per_step": 1e3 * delta["fill_seconds"] / steps,
        "mask_apply_ms_per_step": 1e3 * delta["apply_seconds"] / steps,
        "mask_engine_ms_per_step": 1e3 * delta["blocking_seconds"] / steps,
        "step_ms": 1e3 * seconds / max_tokens,
    }


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians per workload and the ratios the issue asks for."""
    med: dict[str, dict[str, float]] = {}
    for kind in WORKLOADS:
        runs = [r[kind] for r in rounds]
        med[kind] = {k: statistics.median(r[k] for r in runs) for k in runs[0]
                     if isinstance(runs[0][k], (int, float)) and runs[0][k] is not None}
    free_rate = med["free"]["tokens_per_s"]
    per_request_free = free_rate / rounds[0]["free"]["free_requests"]  # every row of "free" is a free request
    ratios = {
        "schema_vs_free_tokens_per_s": med["schema"]["tokens_per_s"] / free_rate,
        "schema_overlap_vs_free_tokens_per_s": med["schema_overlap"]["tokens_per_s"] / free_rate,
        "mixed_free_requests_vs_free_per_request": med["mixed"]["free_request_tokens_per_s"] / per_request_free,
        "mixed_vs_free_tokens_per_s": med["mixed"]["tokens_per_s"] / free_rate,
        # the engine thread's mask time as a share of the same run's step: what the mask costs, whatever
        # the rest of the machine does to the absolute rates (1 - share bounds the ratio it can cause)
        "schema_mask_share_of_step": med["schema"]["mask_engine_ms_per_step"] / med["schema"]["step_ms"],
        "mixed_mask_share_of_step": med["mixed"]["mask_engine_ms_per_step"] / med["mixed"]["step_ms"],
    }
    return {"medians": med, "ratios": ratios,
            "targets": {"schema_vs_free_tokens_per_s": 0.8, "mixed_free_requests_vs_free_per_request": 0.95}}


def markdown(result: dict[str, Any]) -> str:
    s, m = result["summary"], result["summary"]["medians"]
    lines = [
        "# Constrained decoding on CPU (bench/structured/structured_cpu.py)", "",
        (f"SmolLM2-135M-Instruct fp32, {result['num_requests']} requests at once x {result['max_tokens']} tokens "
        f"each, greedy, {result['rounds']} interleaved rounds (medians). {result['machine']}. "
        "The machine is shared with other work: read the ratios, which compare workloads run back to back."), "",
        "| workload | tokens/s | step ms | mask fill ms/step | mask apply ms/step | engine-thread mask ms/step |",
        "|---|---|---|---|---|---|"]
    for kind in WORKLOADS:
        r = m[kind]
        lines.append(f"| {kind} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | {r['mask_fill_ms_per_step']:.2f} | "
                     f"{r['mask_apply_ms_per_step']:.2f} | {r['mask_engine_ms_per_step']:.2f} |")
    lines += ["", "| ratio | measured | target |", "|---|---|---|"]
    for name, value in s["ratios"].items():
        target = s["targets"].get(name)
        lines.append(f"| {name} | {value:.3f} | {'>= ' + str(target) if target else ''} |")
    lines += ["", "Per round (tokens/s; engine-thread mask ms per constrained step):", ""]
    for i, rnd in enumerate(result["runs"]):
        lines.append(f"- round {i}: " + ", ".join(f"{k} {v['tokens_per_s']:.1f} ({v['mask_engine_ms_per_step']:.2f} ms)"
                                                   for k, v in rnd.items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.num_requests < 2 or args.max_tokens < 1 or args.rounds < 1:
        raise SystemExit("--num-requests >= 2, --max-tokens >= 1 and --rounds >= 1")
    llm = LLM(args.model, dtype="float32", max_model_len=1024, max_num_seqs=args.num_requests)
    run_workload(llm, "mixed", args.num_requests, 2)  # warm-up: grammar backend, compile, first steps
    rounds = []
    for _ in range(args.rounds):
        rounds.append({kind: run_workload(llm, kind, args.num_requests, args.max_tokens) for kind in WORKLOADS})
    result = {
        "num_requests": args.num_requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
                   f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} at the end",
        "runs": rounds, "summary": summarize(rounds),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_cpu.json").write_text(json.dumps(result, indent=2))
    (out / "structured_cpu.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
