"""The attention input's epilogue in one launch: the fused q/k/v projection's output (or its split-K
partials) -> RoPE on q and k -> k and v written into the paged cache (INT8-quantized there for an
INT8 cache) -> q returned.

At batch 1 these were three launches per layer: the split-K reduction of the qkv GEMM,
``rotary_qk`` and ``store_kvcache``, each a tiny kernel whose time is mostly launch and one DRAM
round trip. The result is bit-identical to that sequence (``reference.rope_store_kvcache``
composes it): the partials are summed and rounded to the activation dtype as the reduction would,
rotated k is rounded before it is quantized, and the quantization is ``kv_store``'s own
(``kv_quant_jit.quantize_rows``).

Layouts: ``paged_kv`` (cache) and ``norm_rope.rotary_qk`` (rotate-half RoPE from cos/sin tables).
One program per token and KV head; padding tokens (slot -1) still produce their q.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant_jit import quantize_rows
from .kv_store import check_store_target
from .launch_utils import COMPILE_OPTIONS, FLOAT_DTYPES, check_device, next_pow2
from .paged_kv import PagedKV
from .pdl import pdl_launch, pdl_start
from .split_k import SplitKPartials, split_k_args
from .split_k_jit import load_input

NUM_WARPS = 4


@triton.jit
def _load_halves(row, xb_ptr, col, mask, stride_split, num_splits, SPLITS: tl.constexpr, SPLIT_BIAS: tl.constexpr,
                 half, dtype: tl.constexpr):
    """Heads at columns ``col`` (first halves; ``col + half`` the second) of a qkv row (split-K partials
    summed and rounded to ``dtype``, as the reduction would): ``(first, second)`` halves in fp32."""
    x1 = load_input(row, xb_ptr, col, mask, stride_split, num_splits, SPLITS, SPLIT_BIAS, dtype).to(tl.float32)
    x2 = load_input(row, xb_ptr, col + half, mask, stride_split, num_splits, SPLITS, SPLIT_BIAS,
                    dtype).to(tl.float32)
    return x1, x2


@triton.jit
def _rope_halves(row, xb_ptr, col, mask, c, s, stride_split, num_splits, SPLITS: tl.constexpr,
                 SPLIT_BIAS: tl.constexpr, half, dtype: tl.constexpr):
    """:func:`_load_halves`, rotated by ``c``/``s`` and rounded to ``dtype`` (fp32 out)."""
    x1, x2 = _load_halves(row, xb_ptr, col, mask, stride_split, num_splits, SPLITS, SPLIT_BIAS, half, dtype)
    return (x1 * c - x2 * s).to(dtype).to(tl.float32), (x2 * c + x1 * s).to(dtype).to(tl.float32)


@triton.jit
def _store_heads(cache_ptr, sc_ptr, zp_ptr, x1, x2, mask, dst, sdst, hmask, half, QUANT: tl.constexpr):
    """Write one token's ``[heads, head_dim]`` (as its two halves ``x1``, ``x2``) at cache offsets ``dst``
    (first halves); INT8: quantized per head over the whole head_dim, scale/zero at ``sdst``."""
    if QUANT:
        # The halves side by side ([heads, half, 2] -> [heads, 2 half], element order irrelevant to
        # min/max) so kv_store's own per-head quantization applies unchanged.
        x = tl.reshape(tl.join(x1, x2), (x1.shape[0], 2 * x1.shape[1]))
        m = tl.reshape(tl.join(mask, mask), (x1.shape[0], 2 * x1.shape[1]))
        d = tl.reshape(tl.join(dst, dst + half), (x1.shape[0], 2 * x1.shape[1]))
        q, scale, zero = quantize_rows(x, m)
        tl.store(cache_ptr + d, q.to(tl.int8), mask=m)
        tl.store(sc_ptr + sdst, scale.to(tl.float16), mask=hmask)
        tl.store(zp_ptr + sdst, zero.to(tl.float16), mask=hmask)
    else:
        tl.store(cache_ptr + dst, x1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + dst + half, x2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_store_kernel(
    x_ptr, xb_ptr, stride_split, num_splits, pos_ptr, cos_ptr, sin_ptr, q_ptr,
    kc_ptr, vc_ptr, slot_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
    num_heads, num_kv_heads, half, block_size,
    stride_xt, stride_qt, stride_qh, stride_cp, stride_sp,
    stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh,
    SPLITS: tl.constexpr, SPLIT_BIAS: tl.constexpr, QUANT: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    # One program per (token, KV head): the GROUP query heads that share the KV head, the K head and
    # the V head. Spread over num_kv_heads programs, a decode token's split-K partials (S x 12,288
    # fp32 for Llama-2-7B's qkv) are read by as many SMs, not one.
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_mask = offs_c < half
    c = tl.load(cos_ptr + pos * stride_cp + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sp + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    row = x_ptr + t * stride_xt
    head_dim = 2 * half
    heads = kvh * GROUP + tl.arange(0, BLOCK_G)
    mq = (heads[:, None] < (kvh + 1) * GROUP) & c_mask[None, :]
    q1, q2 = _rope_halves(row, xb_ptr, heads[:, None] * head_dim + offs_c[None, :], mq, c, s, stride_split,
                          num_splits, SPLITS, SPLIT_BIAS, half, dt)
    qdst = q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_c[None, :]
    tl.store(qdst, q1.to(dt), mask=mq)
    tl.store(qdst + half, q2.to(dt), mask=mq)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: a padding token, nothing to cache
        kv = kvh + tl.arange(0, 1)  # [1]: this program's KV head, kept 2-D like the q heads
        hmask = kv < num_kv_heads
        mk = hmask[:, None] & c_mask[None, :]
        kcol = (num_heads + kv[:, None]) * head_dim + offs_c[None, :]
        k1, k2 = _rope_halves(row, xb_ptr, kcol, mk, c, s, stride_split, num_splits, SPLITS, SPLIT_BIAS, half, dt)
        vcol = kcol + num_kv_heads * head_dim
        v1, v2 = _load_halves(row, xb_ptr, vcol, mk, stride_split, num_splits, SPLITS, SPLIT_BIAS, half, dt)
        blk = slot // block_size
        off = slot % block_size
        dst = blk * stride_cb + off * stride_co + kv[:, None] * stride_ch + offs_c[None, :]  # K and V share it
        sdst = blk * stride_sb + off * stride_so + kv * stride_sh
        _store_heads(kc_ptr, ks_ptr, kz_ptr, k1, k2, mk, dst, sdst, hmask, half, QUANT)
        _store_heads(vc_ptr, vs_ptr, vz_ptr, v1, v2, mk, dst, sdst, hmask, half, QUANT)


def rope_store_kvcache(
    positions: torch.Tensor,
    qkv: torch.Tensor | SplitKPartials,
    num_heads: int,
    num_kv_heads: int,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv: PagedKV,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``rotary_qk`` + ``store_kvcache`` on a fused qkv projection's output, in one launch.

    Args:
        positions: int32/int64 ``[T]``, each below ``cos_cache.shape[0]`` (not checked: that would sync).
        qkv: float ``[T, (num_heads + 2 num_kv_heads) * D]`` (columns q | k | v, head-major), stride 1 on
            the last dim, or a W4A16 GEMM's :class:`SplitKPartials` of that shape (summed as loaded).
        num_heads, num_kv_heads: query and KV heads.
        cos_cache, sin_cache: float ``[max_position, D // 2]``, stride 1 on the last dim (rotate-half RoPE).
        kv, slot_mapping: as ``store_kvcache`` (``head_dim`` = D); slot -1 = padding (not cached).
    Returns:
        The rotated q, a new ``[T, num_heads, D]`` tensor in qkv's dtype.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    if cos_cache.dim() != 2 or sin_cache.shape != cos_cache.shape or cos_cache.dtype not in FLOAT_DTYPES \
            or cos_cache.stride(1) != 1 or sin_cache.stride(1) != 1:
        raise ValueError(f"rope_store_kvcache: cos/sin caches must be float [max_position, D // 2] with stride 1, "
                         f"got {tuple(cos_cache.shape)} / {tuple(sin_cache.shape)}")
    half = cos_cache.shape[1]
    d = 2 * half
    if kv.head_dim != d:
        raise ValueError(f"rope_store_kvcache: the tables rotate {d} dims but heads have {kv.head_dim}; partial "
                         f"rotary takes rotary_qk + store_kvcache (Attention.forward_qkv does)")
    width = (num_heads + 2 * num_kv_heads) * d
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"rope_store_kvcache: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if len(qkv.shape) != 2 or qkv.shape[1] != width or qkv.dtype not in FLOAT_DTYPES:
        raise ValueError(f"rope_store_kvcache: qkv must be float [T, {width}] ({num_heads} + 2 x {num_kv_heads} heads "
                         f"of {d}), got {tuple(qkv.shape)} {qkv.dtype}")
    t = qkv.shape[0]
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_store_kvcache: positions must be int32/int64 [{t}], got {tuple(positions.shape)}")
    check_store_target("rope_store_kvcache", t, num_kv_heads, d, kv, slot_mapping)
    check_device("rope_store_kvcache", qkv, positions, cos_cache, sin_cache, slot_mapping, *kv.tensors())
    x2, split_args, split_ce = split_k_args("rope_store_kvcache", qkv)
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=x2.device)
    if t:
        quant = kv.is_int8
        ks, kz, vs, vz = kv.scales if quant else (kv.k,) * 4  # unused pointers when not quantizing
        sb, so, sh = kv.k_scale.stride() if quant else (0, 0, 0)
        group = num_heads // num_kv_heads
        rope_store_kernel[(t, num_kv_heads)](
            x2, *split_args, positions, cos_cache, sin_cache, q, kv.k, kv.v, slot_mapping, ks, kz, vs, vz,
            num_heads, num_kv_heads, half, kv.block_size,
            x2.stride(0), q.stride(0), q.stride(1), cos_cache.stride(0), sin_cache.stride(0),
            kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), sb, so, sh,
            QUANT=quant, GROUP=group, BLOCK_G=next_pow2(group), BLOCK_HALF=next_pow2(half),
            num_warps=NUM_WARPS, **{"SPLITS": False, "SPLIT_BIAS": False, **split_ce}, **pdl_launch(q.device),
            **COMPILE_OPTIONS,
        )
    return q
