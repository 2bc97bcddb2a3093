"""The AMX 4-bit product (``native/cpu_w4_amx.c``) against the paths it replaces, one run, on a CPU with AMX.

    .venv/bin/python -m bench.kernels.cpu_amx [--model smollm2-135m-instruct] [--prompt-lens 32 128 512]
                                      [--batch-sizes 1 8 16] [--repeats 7]

Loads the model twice in one process (the default CPU path: bf16 activations, 4-/8-bit weights): one engine
as it runs on a CPU with AMX, one with ``LIGHTINFER_CPU_AMX=0`` as it runs without (the dense path of a 4-bit
product is the weight dequantized in slices for torch's bf16 GEMM, from 24 rows; decode batches below that on
the block products, recorded and replayed). Interleaved per repeat, medians reported:

* prefill: milliseconds of ``generate`` with one output token for a fresh random prompt of each length (no
  prefix-cache hits): the in-process part of a time to first token;
* decode step: milliseconds of one decode step of each batch size (``cpu_step_floor.step_ms``).

Writes ``bench/results/cpu_amx.json``. Exits 2 on a CPU without AMX.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.machine import cpu_name
from bench.common.results import RESULTS, utc_now, write_json
from bench.kernels.cpu_step_floor import step_ms

SETTINGS = ("amx", "no amx")


def prefill_ms(llm: Any, prompt_len: int, rng: random.Random) -> float:
    """Milliseconds of ``generate`` with one output token for a fresh random prompt of ``prompt_len`` tokens."""
    from lightinfer import SamplingParams

    prompt = {"prompt_token_ids": [rng.randint(100, 30000) for _ in range(prompt_len)]}
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per measurement")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_amx.json")
    args = ap.parse_args(argv)

    from lightinfer import LLM
    from lightinfer.kernels import cpu_native, switches

    if not cpu_native.amx_available():
        print("this CPU (or its kernel) offers no AMX-BF16: nothing to compare", file=sys.stderr)
        return 2
    max_len = max(args.prompt_lens + [128]) + args.steps + 64
    engines = {}
    for name in SETTINGS:
        with switches.override(cpu_amx=name == "amx"):
            engines[name] = LLM(args.model, max_model_len=max_len)
    rng = random.Random(0)
    prefill: dict[int, dict[str, list[float]]] = {n: {s: [] for s in SETTINGS} for n in args.prompt_lens}
    step: dict[int, dict[str, list[float]]] = {b: {s: [] for s in SETTINGS} for b in args.batch_sizes}
    for warm in (True, False):  # one pass to warm up (first-call allocations, oneDNN's kernels, recordings)
        for _ in range(1 if warm else args.repeats):
            for name in SETTINGS:
                with switches.override(cpu_amx=name == "amx"):
                    for n in args.prompt_lens:
                        t = prefill_ms(engines[name], n, rng)
                        if not warm:
                            prefill[n][name].append(t)
                    for b in args.batch_sizes:
                        t = step_ms(engines[name], b, 2 if warm else args.steps, 128, rng)
                        if not warm:
                            step[b][name].append(t)

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads, medians of {args.repeats}\n")
    print("| | AMX product | without (torch GEMM / block products) | ratio |")
    print("|---|---|---|---|")
    rows = []
    for n in args.prompt_lens:
        a, b = med(prefill[n]["amx"]), med(prefill[n]["no amx"])
        rows.append({"kind": "prefill", "tokens": n, "amx_ms": a, "no_amx_ms": b, "all_ms": prefill[n]})
        print(f"| prefill of {n} tokens | {a:.1f} ms | {b:.1f} ms | {a / b:.2f} |")
    for bsz in args.batch_sizes:
        a, b = med(step[bsz]["amx"]), med(step[bsz]["no amx"])
        rows.append({"kind": "decode step", "sequences": bsz, "amx_ms": a, "no_amx_ms": b, "all_ms": step[bsz]})
        print(f"| decode step, {bsz} sequences | {a:.2f} ms | {b:.2f} ms | {a / b:.2f} |")
    write_json(args.out, {
        "taken": utc_now(), "model": args.model, "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "rows": rows,
    })
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
