"""Fused-MoE kernel benchmark, prepared for a GPU session (``--smoke`` runs tiny shapes on the CPU).

For the MoE layers of Qwen3-30B-A3B (128 experts, top-8, H 2048, expert width 768) and Mixtral-8x7B (8 experts,
top-2, H 4096, width 14336), W4 g128 experts, fp16 activations, and each batch of ``T`` tokens, one run times:

* ``fused``: ``kernels/fused_moe.py`` (token sort + gate/up+SiLU launch + down launch + top-k sum);
* ``per_expert_loop``: what an engine without the kernel does, the ``transformers`` loop with our W4A16 GEMM
  (its fast integer-zero decode: the bench's zeros are 8):
  for every expert that received tokens, gather them, W4 gate/up GEMM, SiLU-and-mul, W4 down GEMM, weighted
  ``index_add_`` (eager: it reads the routing on the host);
* ``dense_w4_same_active``: one dense W4 MLP as wide as the experts one token uses (``top_k x`` the expert
  width): the same weight bytes per token at ``T = 1``, the floor a MoE decode step can hope for.

Routing is a softmax top-k of random logits (about uniform load over experts; real routers are skewed, which
favours the per-expert loop less than this). Each shape's fused output is also checked against the naive twin
(``reference.fused_moe``). GPU timings replay CUDA graphs (``triton.testing.do_bench_cudagraph``) except the
loop (host sync). Writes ``bench/results/moe_gpu.json`` (``--out``): µs per call and ratios to the fused kernel.

Usage: ``python -m bench.kernels.moe_gpu [--quick] [--out PATH]`` on a GPU; ``python -m bench.kernels.moe_gpu --smoke`` anywhere (CPU:
the Triton kernel under ``TRITON_INTERPRET=1``, else the ``torch_cpu`` backend's path; timings meaningless).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common.results import RESULTS

# name -> (experts, top_k, hidden, expert width)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
SMOKE_SHAPES = {"tiny": (8, 2, 128, 64)}
BATCHES = [1, 4, 16, 64, 256, 1024]
SMOKE_BATCHES = [1, 5]
GROUP_SIZE = 128


def random_w4(e: int, n: int, k: int, g: int, dtype: torch.dtype, device: torch.device) -> Any:
    """Random W4 experts ``[e, n, k]`` (codes uniform, zero 8, scales ~0.004) in the stacked run-time layout."""
    from lightinfer.kernels import ExpertWeights

    qweight = torch.randint(-2**31, 2**31 - 1, (e, n, k // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(e, k // g, n, device=device) * 0.004 + 0.002).to(dtype)
    return ExpertWeights(qweight=qweight, scales=scales, zeros=torch.full_like(scales, 8.0))


def per_expert_loop(ops: Any, x: torch.Tensor, w13: Any, w2: Any, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """The per-expert loop with the backend's W4A16 GEMM (module docstring)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = ops.w4a16_gemm(x[tok], w13.qweight[e], w13.scales[e], w13.zeros[e], integer_zeros=True)
        y = ops.w4a16_gemm(ops.silu_and_mul(h), w2.qweight[e], w2.scales[e], w2.zeros[e], integer_zeros=True)
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def dense_same_active(ops: Any, x: torch.Tensor, gate_up: Any, down: Any) -> torch.Tensor:
    """One W4 MLP (``gate_up`` ``[2 k I, H]``, ``down`` ``[H, k I]``, single-expert ExpertWeights)."""
    h = ops.w4a16_gemm(x, gate_up.qweight[0], gate_up.scales[0], gate_up.zeros[0], integer_zeros=True)
    return ops.w4a16_gemm(ops.silu_and_mul(h), down.qweight[0], down.scales[0], down.zeros[0], integer_zeros=True)


def timer(device: torch.device, quick: bool) -> Callable[[Callable[[], Any], bool], float]:
    """``time(fn, graph)`` -> µs per call: CUDA graphs / events on a GPU, wall clock on the CPU."""
    if device.type == "cuda":
        import triton.testing

        def gpu(fn: Callable[[], Any], graph: bool) -> float:
            reps = 20 if quick else 100
            if graph:
                return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=reps)
            return 1e3 * triton.testing.do_bench(fn, rep=reps)
        return gpu

    def cpu(fn: Callable[[], Any], graph: bool) -> float:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return cpu


def run_shape(name: str, shape: tuple[int, int, int, int], batches: list[int], device: torch.device,
              dtype: torch.dtype, group_size: int, quick: bool, backend: str) -> list[dict[str, Any]]:
    """Every batch of one layer shape: µs of the three variants, ratios, and the fused kernel's error."""
    from lightinfer.kernels import get_backend
    from lightinfer.kernels import reference as ref

    e, k, h, inter = shape
    ops = get_backend(backend)
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2 = random_w4(e, 2 * inter, h, group_size, dtype, device), random_w4(e, h, inter, group_size, dtype, device)
    gate_up, down = random_w4(1, 2 * k * inter, h, group_size, dtype, device), random_w4(1, h, k * inter, group_size,
                                                                                            dtype, device)
    time_us = timer(device, quick)
    rows = []
    for t in batches:
        x = torch.randn(t, h, generator=gen, device=device).to(dtype)
        logits = torch.randn(t, e, generator=gen, device=device)
        weights, ids = torch.softmax(logits, -1).topk(k, -1)
        fused = ops.fused_moe(x, w13, w2, weights, ids)
        check = min(t, 4)  # the naive twin is slow: compare the first rows
        want = ref.fused_moe(x[:check], w13, w2, weights[:check], ids[:check]).float()
        err = float((fused[:check].float() - want).abs().max() / want.abs().max().clamp(min=1e-6))
        row = {"model": name, "tokens": t, "experts": e, "top_k": k, "hidden": h, "expert_width": inter,
               "fused_rel_err": err,
               "fused_us": time_us(lambda x=x, w=weights, i=ids: ops.fused_moe(x, w13, w2, w, i), True),
               "per_expert_loop_us": time_us(lambda x=x, w=weights, i=ids: per_expert_loop(ops, x, w13, w2, w, i),
                                             False),
               "dense_w4_same_active_us": time_us(lambda x=x: dense_same_active(ops, x, gate_up, down), True)}
        row["loop_over_fused"] = row["per_expert_loop_us"] / row["fused_us"]
        row["fused_over_dense_same_active"] = row["fused_us"] / row["dense_w4_same_active_us"]
        weight_bytes = 3 * inter * h * (0.5 + 4 / group_size) * min(e, t * k)  # experts touched, at most
        row["fused_weight_gb_per_s"] = weight_bytes / row["fused_us"] / 1e3
        rows.append(row)
        print(f"{name:14s} T={t:5d}  fused {row['fused_us']:9.1f} us  loop {row['per_expert_loop_us']:9.1f} us "
              f"({row['loop_over_fused']:.2f}x)  dense-same-active {row['dense_w4_same_active_us']:8.1f} us  "
              f"err {err:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and batches")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/moe_gpu.json; smoke: none)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("bench/kernels/moe_gpu.py times the Triton kernel on a GPU; on this machine run it with --smoke", file=sys.stderr)
        raise SystemExit(2)
    import os

    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    backend = "triton" if device.type == "cuda" or interpreting else "torch_cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    batches = SMOKE_BATCHES if args.smoke else (BATCHES[:4] if args.quick else BATCHES)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    rows = [r for name, shape in shapes.items()
            for r in run_shape(name, shape, batches, device, dtype, 64 if args.smoke else GROUP_SIZE, args.quick,
                               backend)]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "backend": backend, "dtype": str(dtype), "group_size": GROUP_SIZE, "rows": rows,
              "torch": torch.__version__}
    out = args.out or (None if args.smoke else str(RESULTS / "moe_gpu.json"))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
