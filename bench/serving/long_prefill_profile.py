"""Where a long prefill's time goes on the CPU: one prompt of each length run through the engine under torch's
profiler: the top torch operators by their own CPU time as shares of the wall time, and what lies outside torch's
operators (lightinfer's C ops, which the profiler cannot see, and Python).

The embedded SmolLM2 from its GGUF, ``LLM(...)``'s defaults (on a CPU bf16 activations, 4-bit weights kept
4-bit), ``max_model_len`` 8192 (its whole context), the prefill chunk (``long_prefill_token_threshold``)
as the engine sets it. Each prompt is prefilled once unprofiled (warm-up), then once profiled (one output token).
Writes ``bench/results/long_prefill_profile.json`` and prints a markdown table.

    python -m bench.serving.long_prefill_profile [--lengths 512 1536 4096 8000] [--top 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.common.results import RESULTS, git_commit, utc_now, write_json

MODEL = "smollm2-135m-instruct"


def profile_prefill(llm: Any, prompt_ids: list[int], top: int) -> dict[str, Any]:
    """One prefill of ``prompt_ids`` (one token out) under ``torch.profiler``: wall seconds, tokens/s and the
    ``top`` operators by self CPU time (ms and share of the total self time)."""
    from torch.profiler import ProfilerActivity, profile

    from lightinfer import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    profiled_us = (time.perf_counter() - t0) * 1e6
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    aten_us = sum(e.self_cpu_time_total for e in events)
    rows = [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1000, 1), "calls": e.count,
             "share": round(e.self_cpu_time_total / profiled_us, 3)}
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]]
    # lightinfer's C ops (the 4-bit products, norms, RoPE + KV store) are called through ctypes / its extension
    # module, not torch ops: the profiler cannot see them, so they are what the torch ops leave of the wall time
    rows.append({"op": "outside torch ops (lightinfer's C ops, Python)", "calls": None,
                 "self_ms": round(max(profiled_us - aten_us, 0) / 1000, 1),
                 "share": round(max(profiled_us - aten_us, 0) / profiled_us, 3)})
    return {"tokens": len(prompt_ids), "wall_s": round(wall, 3), "tokens_per_s": round(len(prompt_ids) / wall, 1),
            "profiled_wall_s": round(profiled_us / 1e6, 3), "top": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightinfer import LLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1536, 4096, 8000])
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", type=Path, default=RESULTS / "long_prefill_profile.json")
    args = ap.parse_args(argv)
    longest = max(args.lengths)
    # SmolLM2's whole context; no prefix caching, or the repeated prompt would be served from the cache
    llm = LLM(MODEL, max_model_len=8192, enable_prefix_caching=False, show_progress=False)
    tok = llm.llm_engine.tokenizer
    text = Path(__file__).read_text(encoding="utf-8")  # any English-ish text, repeated to length
    ids = tok.encode(text, add_special_tokens=False)
    ids = (ids * (longest // len(ids) + 1))[:longest]
    info = llm.llm_engine.model_info()
    runs = [profile_prefill(llm, ids[:n], args.top) for n in args.lengths]
    result = {"date": utc_now(), "commit": git_commit(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
              "model": MODEL, "dtype": info.get("dtype"),
              "prefill_chunk": getattr(llm.llm_engine.config, "long_prefill_token_threshold", None), "runs": runs}
    write_json(args.out, result)
    print(json.dumps({r["tokens"]: r["tokens_per_s"] for r in runs}))
    for r in runs:
        print(f"\n{r['tokens']} tokens: {r['wall_s']} s ({r['tokens_per_s']} tok/s)\n\n| op | self ms | calls | share |\n"
              "|---|---:|---:|---:|")
        for row in r["top"]:
            print(f"| `{row['op']}` | {row['self_ms']:,} | {row['calls'] or ''} | {100 * row['share']:.1f}% |")
    return result


if __name__ == "__main__":
    main()
