"""The CPU's 4-bit products against each other, in the engine, one run: ``LIGHTINFER_CPU_W4`` = ``c``, ``int8``
and ``torch``.

    .venv/bin/python -m bench.kernels.cpu_w4 [--model smollm2-135m-instruct] [--steps 32] [--repeats 3]
                                     [--ppl-tokens 4096] [--no-ppl] [--gemm | --gemm-only]

Loads the model once per product in one process: ``c`` (the default: ``cpu_native.w4_linear``, activations
int16 per block of 32), ``int8`` (the same, activations quantized to int8 per block of 32) and
``torch`` (torch's ``_weight_int4pack_mm_for_cpu``, bf16 activations); then ``exact`` (fp32, weights
dequantized) for perplexity. Measures, interleaved per repeat so the machine's drift hits all alike, the
milliseconds of one decode step at 1 and 16 sequences (as ``cpu_step_floor.py``: generate with ``1 + steps``
tokens minus generate with 1) and of a 512-token prefill; then held-out perplexity (``lightinfer.evaluate``,
1,024-token windows). Before that (``--gemm``, or alone with ``--gemm-only``), each layer shape of SmolLM2
through ``cpu_quant_linear`` in each layout, bf16 input, at 1, 4, 16 and 512 rows: "hot" (one weight, called
again and again) and "cold" (as many different weights of the shape as fill 64 MB, in turn, as a step reads
them). Writes ``bench/results/cpu_w4.json`` and prints markdown tables of ratios to ``torch``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.common.machine import cpu_name
from bench.common.results import RESULTS, write_json
from bench.kernels.cpu_step_floor import step_ms


def prefill_ms(llm: Any, tokens: int, rng: random.Random) -> float:
    """Milliseconds of one ``tokens``-long prefill (generate with one output token, a fresh random prompt)."""
    from lightinfer import SamplingParams

    prompt = {"prompt_token_ids": [rng.randint(100, 30000) for _ in range(tokens)]}
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536)}


MODES = ("c", "int8", "torch")  # the values of LIGHTINFER_CPU_W4 compared, the last the baseline


def gemm_table(rows: tuple[int, ...] = (1, 4, 16, 512)) -> dict[str, dict[str, float]]:
    """µs per call (median of 5 passes) of each shape, every layout, hot and cold (module docstring)."""
    from lightinfer.kernels import cpu_quant_linear, pack_int4_rows, prepare_w4_cpu, switches

    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for name, (n, k) in SHAPES.items():
        count = max(8, (64 << 20) // (n * k // 2))
        weights: dict[str, list[Any]] = {mode: [] for mode in MODES}
        for _ in range(count):
            codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
            scales = (torch.rand(k // 32, n, generator=gen) * 0.01 + 0.001).half().float()
            zeros = torch.rand(k // 32, n, generator=gen) * 15
            qweight = pack_int4_rows(codes)
            for mode in MODES:
                with switches.override(cpu_w4=mode):
                    weights[mode].append(prepare_w4_cpu(qweight, scales, zeros))
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16()
            for temp in ("hot", "cold"):
                for layout, ws in weights.items():
                    use = ws if temp == "cold" else ws[:1] * min(count, 40)
                    passes = []
                    for _ in range(5):
                        start = time.perf_counter()
                        for w in use:
                            cpu_quant_linear(x, w)
                        passes.append((time.perf_counter() - start) / len(use) * 1e6)
                    out.setdefault(f"{name}, {m} rows, {temp}", {})[layout] = round(statistics.median(passes), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--no-ppl", action="store_true", help="timings only")
    ap.add_argument("--gemm", action="store_true", help="also the per-call table (module docstring)")
    ap.add_argument("--gemm-only", action="store_true", help="only the per-call table")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_w4.json")
    args = ap.parse_args()

    from lightinfer import LLM
    from lightinfer.evaluate import perplexity
    from lightinfer.kernels import switches

    gemm = gemm_table() if args.gemm or args.gemm_only else {}
    if gemm:
        print("| shape, rows, weights | " + " | ".join(f"{m} µs" for m in MODES) + " | "
              + " | ".join(f"{m} / torch" for m in MODES[:-1]) + " |\n|---" * 1 + "|---" * (2 * len(MODES) - 1) + "|")
        for key, v in gemm.items():
            print(f"| {key} | " + " | ".join(str(v[m]) for m in MODES) + " | "
                  + " | ".join(f"{v[m] / v['torch']:.2f}" for m in MODES[:-1]) + " |", flush=True)
    if args.gemm_only:
        return
    llms = {}
    for mode in MODES:
        with switches.override(cpu_w4=mode):
            llms[mode] = LLM(args.model)
    rng = random.Random(0)
    for llm in llms.values():  # warm-up: first-call allocations, the C library's build
        step_ms(llm, 1, 4, 32, rng)
    times: dict[str, dict[str, list[float]]] = {k: {"1 seq": [], "16 seqs": [], "prefill 512": []} for k in llms}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            times[name]["1 seq"].append(step_ms(llm, 1, args.steps, 128, rng))
            times[name]["16 seqs"].append(step_ms(llm, 16, args.steps, 128, rng))
            times[name]["prefill 512"].append(prefill_ms(llm, 512, rng))
    medians = {k: {m: round(statistics.median(v), 2) for m, v in t.items()} for k, t in times.items()}
    ppl: dict[str, float] = {}
    if not args.no_ppl:
        for name, llm in llms.items():
            ppl[name] = round(perplexity(llm=llm, max_tokens=args.ppl_tokens, window=1024).ppl, 4)
        del llms
        ppl["exact"] = round(perplexity(args.model, dtype="float32", max_tokens=args.ppl_tokens, window=1024).ppl, 4)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    result = {"taken": when, "cpu": cpu_name(), "threads": torch.get_num_threads(), "model": args.model,
              "ms_median": medians, "perplexity": ppl, "ppl_tokens": args.ppl_tokens, "gemm_us": gemm}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"{when}, {cpu_name()}, {torch.get_num_threads()} threads, {args.model}, medians of {args.repeats}")
    print("| | " + " | ".join(MODES) + " | " + " | ".join(f"{m} / torch" for m in MODES[:-1]) + " |\n"
          + "|---" * (2 * len(MODES)) + "|")
    for m in ("1 seq", "16 seqs", "prefill 512"):
        print(f"| ms, {m} | " + " | ".join(str(medians[k][m]) for k in MODES) + " | "
              + " | ".join(f"{medians[k][m] / medians['torch'][m]:.2f}x" for k in MODES[:-1]) + " |")
    if ppl:
        print(f"| perplexity ({args.ppl_tokens} tokens; exact fp32 {ppl['exact']}) | "
              + " | ".join(str(ppl[k]) for k in MODES) + " | "
              + " | ".join(f"{ppl[k] / ppl['torch'] - 1:+.2%} (vs exact {ppl[k] / ppl['exact'] - 1:+.2%})"
                           for k in MODES[:-1]) + " |")


if __name__ == "__main__":
    main()
