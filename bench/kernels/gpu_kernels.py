"""Kernel benchmark (GPU only): W4A16 GEMM and paged-attention decode against their baselines.

Measures, in one run (so every baseline shares the GPU's state):

* copy bandwidth: a 1 GiB device-to-device copy, counted as bytes read + written;
* W4A16 GEMM on the Llama-2-7B and Llama-3-8B linear shapes (qkv, o, gate_up, down) for every M
  in ``M_VALUES``: our launcher (auto path, tuned where ``kernels/configs`` has this GPU) and each forced
  path (``swap_ab`` at its built-in tile; at ``F32_DECODE_M`` tiled and swap_ab also with the fp32 weight
  decode, ``*_f32decode_us``; at ``FRACZERO_M`` the auto launch with fractional zero points, GGUF Q4_1 /
  Q4_K's exact decode, ``ours_fraczero_us``), torch fp16 matmul (cuBLAS)
  on the dense weight, and AutoAWQ's Triton GEMM when ``.oracle/`` holds autoawq 0.2.9
  (``pip download --no-deps autoawq==0.2.9 -d .oracle`` and unpack; never committed);
* paged-attention decode, batch x context in ``ATTN_BATCHES`` x ``ATTN_CONTEXTS``, fp16 and INT8
  caches, against torch SDPA on contiguous fp16 K/V;
* a batch-1 decode step's GEMMs and norms over 32 Llama-2-7B-shaped layers, one CUDA graph, with
  programmatic dependent launch off and on;

and writes ``bench/results/gpu_kernels.json`` (µs, effective GB/s, ratios, the issue's targets).
Without CUDA it prints why and exits with status 2.

Measures the kernels through their own entry points (``lightinfer.kernels``: the seam it times).

Usage: ``python -m bench.kernels.gpu_kernels [--out PATH] [--quick] [--oracle-dir .oracle]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common.gpu_timing import bench_us, copies_for, copy_bandwidth
from bench.common.results import RESULTS, ROOT, write_json

M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
F32_DECODE_M = (16, 64)  # also time tiled / swap_ab with the fp32 weight decode (LIGHTINFER_F16_DECODE=0) here
FRACZERO_M = (1, 16, 64)  # also time the auto launch with fractional zero points (integer_zeros=False) here
GROUP_SIZE = 128
# (model, layer) -> (K, N): y[M, N] = x[M, K] @ W[K, N]
LINEAR_SHAPES: dict[str, tuple[int, int]] = {
    "llama2-7b/qkv": (4096, 12288), "llama2-7b/o": (4096, 4096),
    "llama2-7b/gate_up": (4096, 22016), "llama2-7b/down": (11008, 4096),
    "llama3-8b/qkv": (4096, 6144), "llama3-8b/o": (4096, 4096),
    "llama3-8b/gate_up": (4096, 28672), "llama3-8b/down": (14336, 4096),
}
ATTN_BATCHES = [1, 16, 64]
ATTN_CONTEXTS = [512, 2048, 8192]
ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK = 32, 8, 128, 16  # Llama-3-8B


def _load_autoawq(oracle_dir: Path) -> Callable[..., torch.Tensor] | None:
    """AutoAWQ's ``awq_gemm_triton`` from an unpacked autoawq 0.2.9 under ``oracle_dir``, else None."""
    import importlib.util

    hits = sorted(oracle_dir.glob("**/awq/modules/triton/gemm.py")) if oracle_dir.exists() else []
    if not hits:
        return None
    spec = importlib.util.spec_from_file_location("_autoawq_triton_gemm", hits[0])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.awq_gemm_triton


def bench_gemm(quick: bool, oracle_dir: Path, m_values: list[int]) -> list[dict[str, Any]]:
    """One row per (shape, M): µs and effective GB/s of each implementation."""
    from lightinfer.kernels import reference as ref
    from lightinfer.kernels import switches
    from lightinfer.kernels import w4a16_gemm as wg

    awq = _load_autoawq(oracle_dir)
    print(f"AutoAWQ Triton GEMM: {'found' if awq else 'not found under ' + str(oracle_dir)}", flush=True)
    rows = []
    for name, (k, n) in LINEAR_SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(k * n)
        codes = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.int32)
        zcodes = torch.randint(0, 16, (k // GROUP_SIZE, n), generator=gen, device="cuda", dtype=torch.int32)
        scales = (torch.rand(k // GROUP_SIZE, n, generator=gen, device="cuda") * 0.01 + 1e-3).half()
        qweight, zeros = ref.pack_int4_rows(codes), zcodes.half()
        w_dense = ref.dequantize_w4(qweight, scales, zeros)  # [N, K] fp16, the cuBLAS baseline's weight
        awq_args = (ref.pack_awq(codes.t().contiguous()), scales, ref.pack_awq(zcodes)) if awq else None
        del codes
        w_bytes = n * k // 2 + 2 * 2 * (k // GROUP_SIZE) * n
        nw4 = copies_for(w_bytes)
        w4_sets = [(qweight, scales, zeros)] + [(qweight.clone(), scales.clone(), zeros.clone()) for _ in range(nw4 - 1)]
        frac_sets = [(q, s, z + 0.5) for q, s, z in w4_sets]  # fractional zero points (as GGUF Q4_1 / Q4_K)
        nfp = copies_for(2 * n * k)
        fp_sets = [w_dense] + [w_dense.clone() for _ in range(nfp - 1)]
        awq_sets = ([awq_args] + [tuple(t.clone() for t in awq_args) for _ in range(nw4 - 1)]) if awq_args else []
        for m in m_values:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            io_bytes = 2 * m * k + 2 * m * n
            launch = wg.choose_launch(m, n, k, GROUP_SIZE, x.device)
            builtin = wg.default_launch(m, n, k, GROUP_SIZE, x.device)
            row: dict[str, Any] = {"shape": name, "K": k, "N": n, "M": m, "path": launch.path,
                                   "launch": dataclasses.asdict(launch), "tuned": launch != builtin,
                                   "bytes_w4": w_bytes + io_bytes, "bytes_fp16": 2 * n * k + io_bytes,
                                   "weight_copies": [nw4, nfp]}
            want = torch.nn.functional.linear(x, w_dense)
            row["rel_err"] = float((wg.w4a16_gemm(x, qweight, scales, zeros, integer_zeros=True).float()
                                    - want.float()).norm() / want.float().norm())
            row["ours_us"] = bench_us(lambda x=x, ws=w4_sets: [wg.w4a16_gemm(x, *w, integer_zeros=True) for w in ws],
                                      quick, nw4)
            if m in FRACZERO_M:  # the same launch, exact for fractional zeros: no fp16 pairs, one FADD more per weight
                row["ours_fraczero_us"] = bench_us(lambda x=x, ws=frac_sets: [wg.w4a16_gemm(x, *w) for w in ws],
                                                   quick, nw4)
            if row["tuned"]:  # the built-in launch, for the gain of tuning (kernels/configs/w4a16_<device>.json)
                row["builtin_us"] = bench_us(lambda x=x, ws=w4_sets, la=builtin: [
                    wg.w4a16_gemm_path(x, *w, launch=la, integer_zeros=True) for w in ws], quick, nw4)
            for path in ("gemv", "tiled", "swap_ab", "dequant"):
                if (path == "gemv" and m > 16) or (path == "swap_ab" and m > 256):
                    continue
                row[f"{path}_us"] = bench_us(lambda x=x, p=path, ws=w4_sets: [
                    wg.w4a16_gemm_path(x, *w, path=p, integer_zeros=True) for w in ws], quick, nw4)
                if path in ("tiled", "swap_ab") and m in F32_DECODE_M:  # this GPU's gain of the fp16 pair decode
                    with switches.override(f16_decode=False):
                        row[f"{path}_f32decode_us"] = bench_us(lambda x=x, p=path, ws=w4_sets: [
                            wg.w4a16_gemm_path(x, *w, path=p, integer_zeros=True) for w in ws], quick, nw4)
            row["cublas_fp16_us"] = bench_us(lambda x=x, ws=fp_sets: [torch.nn.functional.linear(x, w) for w in ws], quick, nfp)
            if awq_sets:
                try:
                    row["autoawq_us"] = bench_us(lambda x=x, ws=awq_sets: [awq(x, a[0], a[1], a[2], 8) for a in ws], quick, nw4)
                except Exception as e:  # noqa: BLE001 - the oracle is a baseline only: record, don't stop
                    row["autoawq_error"] = repr(e)[:200]
            row["ours_GBps"] = row["bytes_w4"] / row["ours_us"] / 1e3
            row["cublas_GBps"] = row["bytes_fp16"] / row["cublas_fp16_us"] / 1e3
            row["speedup_vs_cublas"] = row["cublas_fp16_us"] / row["ours_us"]
            if "autoawq_us" in row:
                row["speedup_vs_autoawq"] = row["autoawq_us"] / row["ours_us"]
            rows.append(row)
            print(f"{name:<18} M={m:<5} ours {row['ours_us']:8.1f} us ({row['path']:<7}) "
                  f"{row['ours_GBps']:7.0f} GB/s  cuBLAS {row['cublas_fp16_us']:8.1f} us  "
                  f"x{row['speedup_vs_cublas']:.2f}  " + (f"AutoAWQ {row['autoawq_us']:8.1f} us"
                                                          if "autoawq_us" in row else ""), flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_attention(quick: bool) -> list[dict[str, Any]]:
    """Paged decode (fp16 and int8 caches) vs SDPA on contiguous fp16 K/V, one layer."""
    import torch.nn.functional as F

    from lightinfer.kernels import KVCacheSpec, PagedKV
    from lightinfer.kernels.kv_store import store_kvcache
    from lightinfer.kernels.paged_attention import paged_attention_decode

    h, hkv, d, bs = ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK
    rows = []
    for b in ATTN_BATCHES:
        for ctx in ATTN_CONTEXTS:
            num_blocks = b * ctx // bs
            table = torch.randperm(num_blocks, device="cuda").int().view(b, ctx // bs)
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            k = torch.randn(b, ctx, hkv, d, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            q = torch.randn(b, h, d, device="cuda", dtype=torch.float16)
            slots = (table.long().unsqueeze(-1) * bs + torch.arange(bs, device="cuda")).view(-1)
            row: dict[str, Any] = {"batch": b, "context": ctx}
            # int8: the engine's layout (KVCacheSpec: head-major scale/zero); int8_token_major: the
            # scale/zero tensors contiguous [blocks, block_size, heads] (the layout before), for comparison.
            for kind in ("fp16", "int8", "int8_token_major"):
                dt = torch.float16 if kind == "fp16" else torch.int8
                kc = torch.empty(num_blocks, bs, hkv, d, device="cuda", dtype=dt)
                vc = torch.empty_like(kc)
                if kind == "int8":
                    kv = KVCacheSpec(1, hkv, d, bs, dt).allocate(num_blocks, torch.device("cuda"))
                elif kind == "int8_token_major":
                    kv = PagedKV(kc, vc, *[torch.empty(num_blocks, bs, hkv, device="cuda", dtype=torch.float16)
                                           for _ in range(4)])
                else:
                    kv = PagedKV(kc, vc)
                store_kvcache(k.view(-1, hkv, d), v.view(-1, hkv, d), kv, slots)
                nbytes = sum(t.numel() * t.element_size() for t in kv.tensors())
                nc = copies_for(nbytes)
                sets = [kv] + [PagedKV(*[None if t is None else t.clone() for t in (kv.k, kv.v, *kv.scales)])
                               for _ in range(nc - 1)]
                us = bench_us(lambda q=q, t=table, n=lens, cs=sets: [paged_attention_decode(q, c, t, n, d**-0.5)
                                                                for c in cs], quick, nc)
                row[f"{kind}_us"], row[f"{kind}_GBps"] = us, nbytes / us / 1e3
                del kc, vc, kv
            kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, ctx, D]
            q4 = q.unsqueeze(2)  # [B, H, 1, D]
            nc = copies_for(2 * kt.numel() * 2)
            kv_sets = [(kt, vt)] + [(kt.clone(), vt.clone()) for _ in range(nc - 1)]
            us = bench_us(lambda q4=q4, kvs=kv_sets: [F.scaled_dot_product_attention(q4, a, b, enable_gqa=True)
                                                   for a, b in kvs], quick, nc)
            row["sdpa_us"], row["sdpa_GBps"] = us, 2 * kt.numel() * 2 / us / 1e3
            rows.append(row)
            print(f"decode B={b:<3} ctx={ctx:<5} fp16 {row['fp16_us']:8.1f} us {row['fp16_GBps']:6.0f} GB/s  "
                  f"int8 {row['int8_us']:8.1f} us {row['int8_GBps']:6.0f} GB/s  "
                  f"(token-major scales {row['int8_token_major_us']:8.1f} us)  "
                  f"SDPA {row['sdpa_us']:8.1f} us {row['sdpa_GBps']:6.0f} GB/s", flush=True)
            del k, v, kt, vt
            torch.cuda.empty_cache()
    return rows


def bench_decode_chain(quick: bool, num_layers: int = 32) -> dict[str, Any]:
    """A batch-1 decode step of the Llama-2-7B shape without attention (per layer: the qkv GEMM and its split-K reduction, a copy standing in for attention, the o GEMM and
    fused add + RMSNorm on its partials, gate/up GEMM, SiLU-mul on its partials, the down GEMM and fused add +
    RMSNorm: 6-7 kernels), replayed as one CUDA graph three ways: programmatic dependent launch off, on,
    and on with the W4 GEMMs' L2 prefetch (``kernels/pdl.py``, ``kernels/switches.py``). Every layer has its own weights (3.3 GB in all), so nothing is served from the L2."""
    from lightinfer.kernels import norm_rope as nr
    from lightinfer.kernels import pdl, switches
    from lightinfer.kernels import w4a16_gemm as wg

    shapes = {name.split("/")[1]: kn for name, kn in LINEAR_SHAPES.items() if name.startswith("llama2-7b/")}
    layers = []
    for _ in range(num_layers):
        layer = {}
        for name, (k, n) in shapes.items():
            qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
            scales = torch.rand(k // GROUP_SIZE, n, device="cuda").half() * 0.01
            layer[name] = (qweight, scales, torch.full_like(scales, 8.0))
        layers.append(layer)
    hidden = shapes["o"][1]
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.float16)
    x0 = torch.randn(1, hidden, device="cuda", dtype=torch.float16)

    def step() -> torch.Tensor:
        h, res = nr.rms_norm(x0, norm_w, 1e-5), x0
        for layer in layers:
            attn_out = wg.w4a16_gemm(h, *layer["qkv"], integer_zeros=True)[:, :hidden].contiguous()  # attention stand-in
            h, res = nr.fused_add_rms_norm(wg.w4a16_gemm(attn_out, *layer["o"], defer_reduce=True, integer_zeros=True),
                                           res, norm_w, 1e-5)
            act = nr.silu_and_mul(wg.w4a16_gemm(h, *layer["gate_up"], defer_reduce=True, integer_zeros=True))
            h, res = nr.fused_add_rms_norm(wg.w4a16_gemm(act, *layer["down"], defer_reduce=True, integer_zeros=True),
                                           res, norm_w, 1e-5)
        return h

    weight_bytes = sum(t.numel() * t.element_size() for layer in layers for w in layer.values() for t in w)
    out: dict[str, Any] = {"layers": num_layers, "weight_bytes": weight_bytes}
    for flag, prefetch, key in ((False, False, "plain"), (True, False, "pdl"), (True, True, "pdl_prefetch")):
        with switches.override(pdl=flag, pdl_prefetch=prefetch):  # the launches read them (at graph capture)
            if key == "pdl":
                out["pdl_enabled"] = pdl.pdl_enabled(torch.device("cuda"))  # False before sm_90: then all are plain
            out[f"{key}_us"] = bench_us(step, quick)
            out[f"{key}_GBps"] = weight_bytes / out[f"{key}_us"] / 1e3
    out["pdl_speedup"] = out["plain_us"] / out["pdl_us"]
    out["pdl_prefetch_speedup"] = out["plain_us"] / out["pdl_prefetch_us"]
    print(f"decode chain ({num_layers} layers, no attention): plain {out['plain_us']:.0f} us "
          f"({out['plain_GBps']:.0f} GB/s of weights); PDL x{out['pdl_speedup']:.3f}; PDL + L2 prefetch "
          f"x{out['pdl_prefetch_speedup']:.3f}", flush=True)
    return out


def targets(copy_gbps: float, gemm: list[dict[str, Any]], attn: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, each with the measured value and whether it was met."""
    out: dict[str, Any] = {}

    def mean_speedup(pred: Callable[[int], bool]) -> float | None:
        xs = [r["speedup_vs_cublas"] for r in gemm if pred(r["M"])]
        return sum(xs) / len(xs) if xs else None

    for m, goal in ((1, 3.5), (16, 3.0), (64, 1.5)):
        s = mean_speedup(lambda mm, m=m: mm == m)
        if s is not None:
            out[f"gemm_M{m}_mean_speedup_vs_cublas"] = {"value": s, "target": goal, "met": s >= goal}
    big = [r for r in gemm if r["M"] >= 1024]
    if big:
        worst = min(r["speedup_vs_cublas"] for r in big)
        out["gemm_M_ge_1024_min_ratio_vs_cublas"] = {"value": worst, "target": 0.9, "met": worst >= 0.9}
    largest = sorted({(r["K"] * r["N"], r["shape"]) for r in gemm}, reverse=True)[:2]
    for _, shape in largest:
        r1 = [r for r in gemm if r["shape"] == shape and r["M"] == 1]
        if r1:
            frac = r1[0]["ours_GBps"] / copy_gbps
            out[f"gemm_M1_{shape}_fraction_of_copy_bw"] = {"value": frac, "target": 0.65, "met": frac >= 0.65}
    a = [r for r in attn if r["batch"] == 64 and r["context"] == 2048]
    if a:
        frac = a[0]["int8_GBps"] / copy_gbps
        out["attn_int8_B64_ctx2048_fraction_of_copy_bw"] = {"value": frac, "target": 0.6, "met": frac >= 0.6}
        out["attn_int8_faster_than_fp16_B64_ctx2048"] = {"value": a[0]["fp16_us"] / a[0]["int8_us"], "target": 1.0,
                                                         "met": a[0]["int8_us"] < a[0]["fp16_us"]}
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status (2 without CUDA)."""
    p = argparse.ArgumentParser(description="lightinfer kernel benchmark (needs a CUDA GPU)")
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_kernels.json")
    p.add_argument("--oracle-dir", type=Path, default=ROOT / ".oracle", help="unpacked autoawq 0.2.9 (optional)")
    p.add_argument("--quick", action="store_true", help="shorter timing loops")
    p.add_argument("--m", type=int, nargs="*", default=M_VALUES, help="GEMM M values")
    p.add_argument("--skip", nargs="*", default=[], choices=["gemm", "attn", "decode_chain"], help="sections to skip")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels/gpu_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False. Nothing measured.",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False  # baseline at fp32 accumulation
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "group_size": GROUP_SIZE, "errors": {},
    }
    import triton

    from lightinfer.kernels import w4a16_gemm as wg

    result["triton"] = triton.__version__
    result["crossovers"] = {"GEMV_MAX_M": wg.GEMV_MAX_M, "TILED_MAX_M": wg.TILED_MAX_M}
    from lightinfer.kernels import w4a16_tuning as wt

    tuned = wt.device_file(result["gpu"])
    result["tuned_configs"] = str(tuned) if tuned.exists() else None  # rows say "tuned" where used
    result["timing"] = ("CUDA-graph replay (triton do_bench_cudagraph), median, data rotated past the L2; gemm and attn "
                        "with programmatic dependent launch off (each kernel on its own, as cuBLAS and SDPA run), "
                        "decode_chain with it off and on")
    from lightinfer.kernels import switches

    os.environ[switches.PDL_ENV] = "0"  # decode_chain overrides it per measurement
    switches.reload()
    result["copy"] = copy_bandwidth(args.quick)
    print(f"copy bandwidth: {result['copy']['GBps']:.0f} GB/s (read + write)", flush=True)
    # (The split-K and GEMV tile sweeps that used to be here are bench/kernels/tune_w4a16.py's search now.)
    sections = {"gemm": lambda: bench_gemm(args.quick, args.oracle_dir, args.m),
                "attn": lambda: bench_attention(args.quick),
                "decode_chain": lambda: bench_decode_chain(args.quick)}
    for name, fn in sections.items():
        if name in args.skip:
            continue
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - keep what the other sections measured
            result["errors"][name] = traceback.format_exc()[-3000:]
            print(result["errors"][name], file=sys.stderr, flush=True)
    result["targets"] = targets(result["copy"]["GBps"], result.get("gemm", []), result.get("attn", []))
    for key, t in result["targets"].items():
        print(f"{'MET ' if t['met'] else 'MISS'} {key}: {t['value']:.3f} (target {t['target']})")
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
