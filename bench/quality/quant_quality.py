"""Quantization quality on SmolLM2-135M-Instruct (CPU): issue 3's acceptance numbers.

For each group size (default 64 = auto for SmolLM2, and 32): quantize with RTN and AWQ, then
measure perplexity on the built-in held-out text (>= 20k tokens, never seen by calibration)
through the engine (``LLMEngine.score``, paged-KV prefill), for

  P0        the source GGUF dequantized, fp32 (the reference)
  P_rtn     RTN W4                       P_awq      AWQ W4
  P_awq_kv  AWQ W4 with the INT8 KV cache

and check: P_awq < P_rtn, (P_awq - P0) <= 0.6 (P_rtn - P0), P_awq_kv <= 1.005 P_awq, the
quantized linears' bytes <= 0.30 of fp16, the AWQ model answers "What is the capital of
France?" with Paris (chat template, greedy), and the default AWQ quantize time (target <= 300 s
on 2 CPU cores). Writes ``bench/results/quant_quality.json``.

Usage: ``python -m bench.quality.quant_quality [--group-sizes 64 32] [--window 2048] [--max-tokens N] [--work DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.results import RESULTS as RESULTS_DIR
from lightinfer import LLM, SamplingParams
from lightinfer.evaluate import perplexity
from lightinfer.quant.api import quantize
from lightinfer.quant.config import QuantConfig

MODEL = "smollm2-135m-instruct"
RESULTS = RESULTS_DIR / "quant_quality.json"


def _ppl(model: str, kv: str, window: int, max_tokens: int | None, dtype: str = "float32") -> dict[str, Any]:
    """Perplexity of ``model`` through the engine (``dtype`` activations, ``kv`` KV cache) on the held-out text."""
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, max_model_len=window,
              max_num_batched_tokens=window)
    r = perplexity(llm=llm, window=window, max_tokens=max_tokens)
    print(f"  {model} dtype={dtype} kv={kv}: {r.format()}", flush=True)
    return {"ppl": r.ppl, "tokens_scored": r.tokens_scored, "seconds": round(r.seconds, 1)}


def _paris(model: str) -> dict[str, Any]:
    llm = LLM(model, dtype="float32")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
    print(f"  chat answer: {out!r}", flush=True)
    return {"answer": out, "contains_paris": "paris" in out.lower()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=None, help="score at most N tokens (default: all)")
    ap.add_argument("--work", default="/tmp/lightinfer-quality", help="where the quantized models go")
    ap.add_argument("--num-samples", type=int, default=QuantConfig().num_samples)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--reuse", action="store_true", help="keep quantized models already in --work (no timing)")
    args = ap.parse_args()
    work = Path(args.work)
    torch.manual_seed(0)
    res: dict[str, Any] = {
        "model": MODEL, "text": "pydoc_data.topics prose, held-out half", "window": args.window,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__},
        "P0": _ppl(MODEL, "auto", args.window, args.max_tokens), "group_sizes": {},
    }
    p0 = res["P0"]["ppl"]
    for g in args.group_sizes:
        entry: dict[str, Any] = {}
        for method in ("rtn", "awq"):
            out = work / f"{method}-g{g}"
            cfg = QuantConfig(method=method, group_size=g, num_samples=args.num_samples)
            if not (args.reuse and (out / "config.json").is_file()):
                s = quantize(MODEL, out, cfg, force=True, progress=True)
                print(s.format(), flush=True)
                entry[f"quantize_{method}"] = {
                    "seconds": round(s.seconds, 1), "peak_memory_mib": s.peak_memory_bytes >> 20,
                    "linear_ratio": round(s.linear_ratio, 4), "output_mib": s.output_bytes >> 20,
                    "calib_tokens": s.calib_tokens, "reason": s.group_size_reason}
            entry[f"P_{method}"] = _ppl(str(out), "auto", args.window, args.max_tokens)
        entry["P_awq_kv"] = _ppl(str(work / f"awq-g{g}"), "int8", args.window, args.max_tokens)
        pr, pa, pk = entry["P_rtn"]["ppl"], entry["P_awq"]["ppl"], entry["P_awq_kv"]["ppl"]
        entry["gap_closed"] = round(1 - (pa - p0) / (pr - p0), 4) if pr > p0 else None
        entry["checks"] = {
            "P_awq < P_rtn": pa < pr,
            "(P_awq-P0) <= 0.6 (P_rtn-P0)": (pa - p0) <= 0.6 * (pr - p0),
            "P_awq_kv <= 1.005 P_awq": pk <= 1.005 * pa,
        }
        if "quantize_awq" in entry:
            entry["checks"]["linear bytes <= 0.30 fp16"] = entry["quantize_awq"]["linear_ratio"] <= 0.30
        if g == args.group_sizes[0]:
            entry["chat"] = _paris(str(work / f"awq-g{g}"))
            entry["checks"]["answers Paris"] = entry["chat"]["contains_paris"]
            if "quantize_awq" in entry:
                entry["checks"]["AWQ quantize <= 300 s"] = entry["quantize_awq"]["seconds"] <= 300
        res["group_sizes"][str(g)] = entry
        print(json.dumps({g: entry["checks"], "gap_closed": entry["gap_closed"]}), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")  # partial results survive a crash
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
