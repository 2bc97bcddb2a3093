"""Fused mixture-of-experts: every routed expert of a batch in two launches, W4A16 (or dense) experts.

The layout of the stacked experts and the token sort are :mod:`.moe`'s. Like vLLM's ``fused_moe``:

1. :func:`.moe.moe_align_block_size` sorts the ``T x top_k`` (token, slot) pairs by expert and pads each
   expert's group to ``BLOCK_M`` rows (device tensor ops, no host sync: CUDA-graph safe).
2. **gate/up + SiLU·mul** (one launch, ``GATED``): each program owns one ``BLOCK_M`` tile of sorted pairs (one
   expert, read from ``expert_ids``) and ``BLOCK_N`` columns of the intermediate; it gathers the tokens' rows of
   x, dequantizes the expert's gate rows ``n`` and up rows ``I + n`` tile by tile and keeps two accumulators, so
   the epilogue writes ``silu(gate) * up`` straight into ``inter [T * top_k, I]``. Fusing the activation saves
   writing and re-reading the ``[T * top_k, 2 I]`` pre-activation and the launch of a separate SiLU kernel, at
   the price of two accumulators per program (decided for that: at decode the step is a handful of tiny
   launches per layer, each a fixed cost).
3. **down** (one launch, ``MUL_ROUTED``): the same kernel over ``w2`` reading ``inter`` row by row, each row
   scaled by its routing weight, written to ``out [T * top_k, H]``; the ``top_k`` rows of a token are then
   summed (``sum`` over a ``[T, top_k, H]`` view: deterministic, no atomics).

Tiles past the padded end of the sorted list return at once. Each expert's weights are read once per tile of
its tokens: at decode (one token per expert tile) that is the whole point, at prefill a tile reuses a weight
tile for ``BLOCK_M`` tokens through ``tl.dot``.

Weight decode: the 4-bit code is extracted and converted to fp32, the zero subtracted and the scale applied in
fp32, then cast to the activation dtype for the tensor cores. This is exact for fractional zero points (GGUF
Q4_1 / Q4_K experts) where ``w4_decode``'s exponent trick is not; it costs an integer-to-float conversion per
weight, which the decode step (bandwidth-bound) hides. fp32 activations multiply with
``input_precision="ieee"`` (no TF32). Group sizes 32 / 64 / 128 (``BLOCK_K`` divides G: one scale per row and
K step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch_utils import COMPILE_OPTIONS, FLOAT_DTYPES, check_device, upcast_dot
from .moe import ExpertWeights, check_moe_args, moe_align_block_size
from .pdl import pdl_launch, pdl_start

SUPPORTED_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class MoeConfig:
    """A launch of the fused-MoE kernel: ``[block_m, block_n]`` output tiles, K steps of ``block_k`` (capped at the
    group size), pipelining depth ``num_stages``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Picked by the average number of pairs per expert (decode: ~1). BLOCK_M 16 is tl.dot's smallest tile; the
# prefill tile reuses each dequantized weight tile for 64 tokens. Chosen to fit sm_86's 99 KB of shared memory
# with both accumulators (kernels/audit/smem_check.py compiles them); not yet timed on a GPU
# (bench/kernels/moe_gpu.py times them).
MOE_CONFIGS: tuple[MoeConfig, ...] = (
    MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2),
    MoeConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2),
)
SMALL_MAX_PAIRS_PER_EXPERT = 16


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, n_ok, k0, K, stride_wn, stride_sg,
                 QUANT: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``offs_n`` x columns ``k0 .. k0 + BLOCK_K`` of one expert's weight, fp32 ``[BLOCK_N, BLOCK_K]``."""
    if QUANT:
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :],
                        mask=n_ok[:, None], other=0)  # [BLOCK_N, BLOCK_K // 8]
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        rep = tl.interleave(words, words)
        rep = tl.interleave(rep, rep)
        rep = tl.interleave(rep, rep)  # [BLOCK_N, BLOCK_K]: each word 8 times, k = 8 j + i is nibble i of word j
        codes = (rep >> ((tl.arange(0, BLOCK_K) % 8) * 4)[None, :]) & 15
        w = (codes.to(tl.float32) - z[:, None]) * s[:, None]
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    return w


@triton.jit
def _dot(a, w, acc, UPCAST_DOT: tl.constexpr):
    """``acc + a [M, K] @ w^T`` (``w`` fp32 ``[N, K]``) with the tensor cores in ``a``'s dtype."""
    if a.dtype == tl.float32:
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    elif UPCAST_DOT:  # the CPU interpreter's bf16 dot is broken (launch_utils.upcast_dot)
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(a.dtype).to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return acc


@triton.jit
def fused_moe_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs, a_div, stride_am, stride_we, stride_wn, stride_se, stride_sg, stride_om,
    QUANT: tl.constexpr, GROUP_SIZE: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # One program: a BLOCK_M tile of sorted (token, slot) pairs, all of one expert, x BLOCK_N output columns
    # (intermediate columns when GATED: the expert's gate rows n and up rows N + n).
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # t * top_k + j; padding rows hold num_pairs
    valid = pair < num_pairs
    rows = (pair // a_div).to(tl.int64)  # gate/up: the token's row of x; down: the pair's row of inter
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
        w = _weight_tile(w_e, s_e, z_e, offs_n, n_ok, k0, K, stride_wn, stride_sg, QUANT, GROUP_SIZE, BLOCK_K)
        acc = _dot(a, w, acc, UPCAST_DOT)
        if GATED:
            w_up = _weight_tile(w_e, s_e, z_e, offs_n + N, n_ok, k0, K, stride_wn, stride_sg, QUANT, GROUP_SIZE,
                                BLOCK_K)
            acc_up = _dot(a, w_up, acc_up, UPCAST_DOT)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_ROUTED:
        acc = acc * tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


def pick_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """The launch for ``num_pairs`` routed (token, slot) pairs over ``num_experts`` experts."""
    return MOE_CONFIGS[0] if num_pairs <= SMALL_MAX_PAIRS_PER_EXPERT * num_experts else MOE_CONFIGS[1]


def _check_weights(name: str, w: ExpertWeights, x: torch.Tensor) -> None:
    if w.is_quantized:
        if w.qweight.dtype != torch.int32 or w.scales.dtype not in FLOAT_DTYPES or w.zeros.shape != w.scales.shape:
            raise ValueError(f"fused_moe: {name} must be int32 qweight [E, N, K // 8] with float scales/zeros "
                             f"[E, K // G, N], got {w.qweight.dtype} / {w.scales.dtype} {tuple(w.zeros.shape)}")
        if w.group_size not in SUPPORTED_GROUP_SIZES or w.in_features % w.group_size:
            raise ValueError(f"fused_moe: {name} group size {w.group_size} not in {SUPPORTED_GROUP_SIZES}")
    elif w.weight.dtype != x.dtype:
        raise ValueError(f"fused_moe: dense {name} is {w.weight.dtype}, x is {x.dtype}")
    if not all(t.is_contiguous() for t in w.tensors()):
        raise ValueError(f"fused_moe: {name}'s tensors must be contiguous")


def _launch(a: torch.Tensor, w: ExpertWeights, out: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
            expert_ids: torch.Tensor, num_post: torch.Tensor, n: int, a_div: int, gated: bool, cfg: MoeConfig) -> None:
    quant = w.is_quantized
    wt = w.qweight if quant else w.weight
    s = w.scales if quant else wt  # unused pointers of a dense launch
    z = w.zeros if quant else wt
    block_k = min(cfg.block_k, w.group_size) if quant else cfg.block_k
    grid = (triton.cdiv(sorted_ids.numel(), cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    fused_moe_kernel[grid](
        a, wt, s, z, out, topk_weights, sorted_ids, expert_ids, num_post,
        n, w.in_features, topk_weights.numel(), a_div, a.stride(0), wt.stride(0), wt.stride(1),
        s.stride(0) if quant else 0, s.stride(1) if quant else 0, out.stride(0),
        QUANT=quant, GROUP_SIZE=w.group_size if quant else 0, GATED=gated, MUL_ROUTED=not gated,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, UPCAST_DOT=upcast_dot(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(a.device), **COMPILE_OPTIONS)


def fused_moe(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``reference.fused_moe`` in two Triton launches plus the token sort and a sum (module docstring).

    Args:
        x: ``[T, H]`` float16/bfloat16/float32, contiguous.
        w13: gate and up projections stacked ``[E, 2 I, H]``, w2: down ``[E, H, I]`` (``moe.ExpertWeights``:
            W4 with G in 32/64/128, zeros possibly fractional; or dense in ``x.dtype``).
        topk_weights: float ``[T, top_k]``; topk_ids: int ``[T, top_k]`` in ``[0, E)``.
    Returns:
        ``[T, H]`` in ``x.dtype``.
    Raises:
        ValueError: bad shapes, dtypes, strides or devices (CPU needs ``TRITON_INTERPRET=1``).
    """
    t, h, inter = check_moe_args(x, w13, w2, topk_weights, topk_ids)
    if x.dtype not in FLOAT_DTYPES or not x.is_contiguous():
        raise ValueError(f"fused_moe: x must be a contiguous float16/bfloat16/float32 tensor, got {x.dtype}")
    _check_weights("w13", w13, x)
    _check_weights("w2", w2, x)
    check_device("fused_moe", x, *w13.tensors(), *w2.tensors(), topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    if t == 0:
        return torch.empty_like(x)
    cfg = pick_config(t * top_k, w13.num_experts)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg.block_m, w13.num_experts)
    weights = topk_weights.to(torch.float32).contiguous()
    inter_out = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    _launch(x, w13, inter_out, weights, sorted_ids, expert_ids, num_post, inter, top_k, True, cfg)
    out = torch.empty((t * top_k, h), dtype=x.dtype, device=x.device)
    _launch(inter_out, w2, out, weights, sorted_ids, expert_ids, num_post, h, 1, False, cfg)
    return out.view(t, top_k, h).sum(dim=1)
