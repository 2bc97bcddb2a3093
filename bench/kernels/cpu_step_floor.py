"""Where a CPU decode step's time goes: the low-bit matrix products against everything else, one run.

    .venv/bin/python -m bench.kernels.cpu_step_floor [--model smollm2-135m-instruct] [--batch-sizes 1 16]
                                             [--steps 32] [--repeats 3] [--threads N]

Loads the model once (``LLM``, the default CPU path: bf16 activations, 4-/8-bit weights kept low-bit) and
measures the milliseconds of one decode step at each batch size in four modes, interleaved per repeat so
that the machine's drift hits all of them alike:

* ``replayed``: the step as it runs, the forward replayed from its recorded C calls (``engine/cpu_graph.py``);
* ``eager``: the same step with the forward run eagerly, as ``enforce_eager=True`` runs it;
* ``no layer GEMMs`` (eager): every decoder layer's low-bit product (``cpu_quant_linear``: q/k/v, o,
  gate/up, down) returns zeros of its shape instead; the LM head still runs;
* ``no GEMMs`` (eager): the LM head's product (``cpu_int8_linear`` / the 8-bit halves) returns zeros too.

What is left in ``no GEMMs`` is the floor that a faster matrix product cannot touch in an eager step: norms,
RoPE and the KV store, attention, casts, the sampler and the Python between them; ``eager - replayed`` is the
Python and dispatch that the replay removes. A step is timed as the difference between
``LLM.generate`` with ``1 + --steps`` and with 1 output token for fresh random prompts of ``--prompt-len``
tokens (no prefix cache hits), so prefill is not in it. Zeroed products change the values but not the
shapes or the amount of work elsewhere (greedy decoding with ``ignore_eos``). Writes ``bench/results/cpu_step_floor.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.common.machine import cpu_name
from bench.common.results import RESULTS, utc_now, write_json

MODES = ("replayed", "eager", "no layer GEMMs", "no GEMMs")


@contextlib.contextmanager
def patched(model: torch.nn.Module, mode: str) -> Iterator[None]:
    """Replace the low-bit products of the 4-bit layers (and for ``no GEMMs`` of the 8-bit ones: the LM head) by
    zeros while inside: their weight forms (``layers/weight_forms.py``) swapped for one that returns zeros of
    the product's shape, in the dtype it would return."""
    from lightinfer.layers.linear import W4A16Linear
    from lightinfer.layers.w8_linear import W8A16Linear
    from lightinfer.layers.weight_forms import (
        Int8PerChannelWeight,
        LinearWeight,
        NativeW4Weight,
        TorchInt4Weight,
    )

    class ZeroProduct(LinearWeight):
        def __init__(self, base: Any) -> None:
            self.base = base

        def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return torch.zeros(*x.shape[:-1], self.base.prepared.out_features, dtype=self.base.out_dtype or x.dtype)

        def nbytes(self) -> int:
            return self.base.nbytes()

        def tensors(self) -> list[torch.Tensor]:
            return self.base.tensors()

    kinds: tuple[type, ...] = {"no layer GEMMs": (W4A16Linear,), "no GEMMs": (W4A16Linear, W8A16Linear)}.get(mode, ())
    lowbit = (NativeW4Weight, TorchInt4Weight, Int8PerChannelWeight)
    saved = {m: m.weight_impl for m in model.modules() if isinstance(m, kinds) and isinstance(m.weight_impl, lowbit)}
    try:
        for m, form in saved.items():
            m.weight_impl = ZeroProduct(form)
        yield
    finally:
        for m, form in saved.items():
            m.weight_impl = form


@contextlib.contextmanager
def forward_mode(llm: Any, mode: str) -> Iterator[None]:
    """Decode forwards replayed (``replayed``) or eager (the other modes: their patched products would make
    the recording refuse the batch size for good) while inside."""
    runner = llm.llm_engine.model_runner
    saved = runner.cpu_graph_runner
    if mode != "replayed":
        runner.cpu_graph_runner = None
    try:
        yield
    finally:
        runner.cpu_graph_runner = saved


def forward_ops_ms(llm: Any, batch: int, repeats: int = 20) -> dict[str, float]:
    """Milliseconds per replayed forward of ``batch`` sequences, by C op (each call timed alone, medians of
    ``repeats`` passes; the inputs are the last step's, left in the static buffers), and ``forward``: the
    replay as one call. Empty when that size has no recorded forward."""
    runner = llm.llm_engine.model_runner.cpu_graph_runner
    graph = runner.cpu_graphs.get(batch) if runner is not None else None
    if graph is None:
        return {}
    per_call: list[list[float]] = [[] for _ in graph.calls]
    whole = []
    with torch.inference_mode():
        for _ in range(repeats):
            for i, (fn, args) in enumerate(graph._bound):
                start = time.perf_counter()
                fn(*args)
                per_call[i].append(time.perf_counter() - start)
            start = time.perf_counter()
            graph.replay()
            whole.append(time.perf_counter() - start)
    out: dict[str, float] = {}
    for (name, _), times in zip(graph.calls, per_call):
        out[name] = out.get(name, 0.0) + statistics.median(times) * 1e3
    out["forward"] = statistics.median(whole) * 1e3
    return out


def step_ms(llm: Any, batch: int, steps: int, prompt_len: int, rng: random.Random) -> float:
    """Milliseconds of one decode step of ``batch`` sequences (the generate-with-1-token time subtracted)."""
    from lightinfer import SamplingParams

    def run(max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randint(100, 30000) for _ in range(prompt_len)]} for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return (run(1 + steps) - run(1)) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per measurement (default 32)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's own)")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_step_floor.json")
    args = ap.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.repeats < 1:
        ap.error("--batch-sizes, --steps and --repeats must be >= 1")

    from lightinfer import LLM

    options = {} if args.threads is None else {"threads": args.threads}
    llm = LLM(args.model, max_model_len=args.prompt_len + args.steps + 64, **options)
    rng = random.Random(0)
    for batch in args.batch_sizes:  # warm-up: first-call allocations, the recorded forwards
        step_ms(llm, batch, 2, args.prompt_len, rng)
    times: dict[int, dict[str, list[float]]] = {b: {m: [] for m in MODES} for b in args.batch_sizes}
    for _ in range(args.repeats):
        for batch in args.batch_sizes:
            for mode in MODES:
                with patched(llm.llm_engine.model_runner.model, mode), forward_mode(llm, mode):
                    times[batch][mode].append(step_ms(llm, batch, args.steps, args.prompt_len, rng))

    rows = []
    print(f"\nms per decode step, median of {args.repeats} ({cpu_name()}, "
          f"{torch.get_num_threads()} threads)\n")
    print("| sequences | replayed | eager | replayed / eager | eager: no layer GEMMs | eager: no GEMMs | "
          "eager: layer GEMMs' share | LM head's share | the rest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        replayed, full, no_layers, floor = (statistics.median(times[batch][m]) for m in MODES)
        row = {"sequences": batch, "replayed_ms": replayed, "full_ms": full, "no_layer_gemms_ms": no_layers,
               "no_gemms_ms": floor, "all_ms": times[batch]}
        rows.append(row)
        print(f"| {batch} | {replayed:.1f} | {full:.1f} | {replayed / full:.2f} | {no_layers:.1f} | {floor:.1f} | "
              f"{(full - no_layers) / full:.2f} | {(no_layers - floor) / full:.2f} | {floor / full:.2f} |")
    print("\nThe replayed forward by C op (ms per step, each call timed alone; the step's other work is the "
          "step's replayed time less the forward)\n")
    ops = {batch: forward_ops_ms(llm, batch) for batch in args.batch_sizes}
    names = sorted({n for o in ops.values() for n in o if n != "forward"})
    print("| sequences | " + " | ".join(names) + " | forward (one call) | rest of the step |")
    print("|---|" + "---|" * (len(names) + 2))
    for row in rows:
        o = ops[row["sequences"]]
        row["forward_ops_ms"] = o
        if o:
            print(f"| {row['sequences']} | " + " | ".join(f"{o.get(n, 0.0):.2f}" for n in names) +
                  f" | {o['forward']:.2f} | {row['replayed_ms'] - o['forward']:.2f} |")
    write_json(args.out, {
        "taken": utc_now(), "model": args.model,
        "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(), "steps": args.steps, "prompt_len": args.prompt_len, "rows": rows,
    })
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
