"""Paged attention over the (fp16/bf16/fp32 or INT8) KV cache: decode and prefill.

Cache layout: ``paged_kv`` module docstring (one :class:`PagedKV` per layer). INT8 K/V are never
dequantized element by element: with per-token ``k = kq * ks + kz`` and ``v = vq * vs + vz``,

    q . k_n      = ks_n * (q . kq_n) + kz_n * sum(q)        (int8 codes are exact in fp16/bf16)
    sum_n p_n v_n = (p * vs) @ vq + sum_n p_n vz_n

so the tensor cores see the raw codes and the scale/zero cost is per token, not per element.

Decode (one query token per sequence): one program per (sequence, KV head, context partition)
handles all query heads of the GQA group as rows of one ``tl.dot`` tile, so each K/V byte is
read once per group. Contexts longer than ``PARTITION_SIZE`` are split (flash-decoding): each
partition writes an unnormalised partial output with its running max and sum, and a reduction
kernel combines them. Prefill: one program per (sequence, block of new tokens, query head),
causal over the cached prefix plus the new tokens (already stored), all sequences in one launch.

Sliding windows (``window > 0``: a query at position p sees keys ``p - window < j <= p``, Mistral / Gemma local
layers): both kernels start their key loop at the tile holding the first visible key, so a windowed layer reads
O(window) tokens per query whatever the context, and never the block-table entries before it (the engine frees
those blocks). Soft-capping (``softcap > 0``, Gemma 2): scores ``softcap * tanh(scale * q.k / softcap)``, a
compile-time branch (``SOFTCAP``) so that other models pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_plan import (
    MAX_DECODE_SPLITS,
    MIN_PARTITION_SIZE,
    PARTITION_SIZE,
    decode_block_d,
    decode_split_plan,
)
from .launch_utils import COMPILE_OPTIONS, FLOAT_DTYPES, check_device, next_pow2, upcast_dot
from .norm_rope import tanh_f32
from .paged_kv import PagedKV
from .pdl import pdl_launch, pdl_start

__all__ = ["DECODE_CONFIGS", "MAX_DECODE_SPLITS", "MIN_PARTITION_SIZE", "PARTITION_SIZE", "PREFILL_CONFIGS",
           "PREFILL_INT8_CONFIGS", "PREFILL_WINDOW_CONFIGS", "AttnConfig", "attn_config", "decode_split_plan",
           "paged_attention_decode", "paged_attention_decode_impl", "paged_attention_prefill", "paged_decode_kernel",
           "paged_decode_reduce_kernel", "paged_prefill_kernel", "prefill_config"]


@dataclass(frozen=True)
class AttnConfig:
    """Tile: ``block_n`` keys per step for head sizes up to ``max_head_dim``."""

    max_head_dim: int
    block_n: int
    num_warps: int
    num_stages: int


DECODE_CONFIGS: list[AttnConfig] = [AttnConfig(128, 64, 4, 2), AttnConfig(256, 32, 4, 2)]
PREFILL_CONFIGS: list[AttnConfig] = [AttnConfig(128, 64, 4, 2), AttnConfig(256, 32, 8, 2)]
# An INT8 cache adds the scale/zero vectors and the code conversion to every tile: at the fp16 tiles
# its prefill kernel ran out of registers (sm_86: 255 registers and 114 spill stores at head_dim 128,
# 18 at 64; sm_90, head_dim 256: 112 bytes of stack). Half the keys per step spill on neither
# (``python -m lightinfer.kernels.audit.smem_check`` reports registers and spills).
PREFILL_INT8_CONFIGS: list[AttnConfig] = [AttnConfig(128, 32, 4, 2), AttnConfig(256, 16, 8, 2)]
# A sliding window's extra mask tipped the fp16 tile at head_dim 128 over sm_86's 255 registers (13 spill
# stores); half the keys per step does not spill. INT8 caches keep their (already smaller) tiles.
PREFILL_WINDOW_CONFIGS: list[AttnConfig] = [AttnConfig(128, 32, 4, 2), AttnConfig(256, 32, 8, 2)]
PREFILL_BLOCK_M = 64
REDUCE_NUM_WARPS = 4


def prefill_config(head_dim: int, int8_cache: bool, window: bool) -> AttnConfig:
    """The prefill tile for ``head_dim``, an INT8 (or float) cache, with or without a sliding window."""
    if int8_cache:
        return attn_config(PREFILL_INT8_CONFIGS, head_dim)
    return attn_config(PREFILL_WINDOW_CONFIGS if window else PREFILL_CONFIGS, head_dim)


def attn_config(configs: list[AttnConfig], head_dim: int) -> AttnConfig:
    """The first of ``configs`` that covers ``head_dim``.

    Raises:
        ValueError: ``head_dim`` is larger than every config's ``max_head_dim``.
    """
    for c in configs:
        if head_dim <= c.max_head_dim:
            return c
    raise ValueError(f"paged attention: head_dim {head_dim} > {configs[-1].max_head_dim} is not supported")


@triton.jit
def _int8_to_f16(x):
    """int8 codes -> exact fp16 without a (quarter-rate) int->float conversion.

    ``0x6400 + (x + 128)`` read as fp16 is ``1024 + x + 128`` (spacing 1 in [1024, 2048)).
    """
    bits = x.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480  # byte b: 0x6400 | (b ^ 0x80) = 0x6480 + x
    return bits.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _gather_rows(bt_row_ptr, n0, n_lo, n_end, kvh, stride_b, stride_o, stride_h,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """Offsets ``[BLOCK_N]`` of keys ``n0 .. n0 + BLOCK_N`` (page ``// BLOCK_SIZE``, slot ``% BLOCK_SIZE``) for
    strides ``(stride_b, stride_o, stride_h)`` of a ``[blocks, block_size, heads, ...]`` tensor, and their mask
    (keys below ``n_end`` and, with ``WINDOW``, from ``n_lo``: block-table entries outside are never read)."""
    tok = n0 + tl.arange(0, BLOCK_N)
    t_mask = tok < n_end
    if WINDOW:
        t_mask = t_mask & (tok >= n_lo)
    phys = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    return phys * stride_b + (tok % BLOCK_SIZE) * stride_o + kvh * stride_h, t_mask


@triton.jit
def _gather_pages(bt_row_ptr, n0, n_lo, n_end, kvh, stride_b, stride_o, stride_h,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """:func:`_gather_rows` shaped ``[BLOCK_N // BLOCK_SIZE, BLOCK_SIZE]`` (``n0`` a multiple of BLOCK_SIZE):
    one block-table read per page, and the slots of a page one strided run."""
    pages = n0 // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
    slot = tl.arange(0, BLOCK_SIZE)
    tok = pages[:, None] * BLOCK_SIZE + slot[None, :]
    t_mask = tok < n_end
    page_mask = pages * BLOCK_SIZE < n_end
    if WINDOW:
        t_mask = t_mask & (tok >= n_lo)
        page_mask = page_mask & ((pages + 1) * BLOCK_SIZE > n_lo)
    phys = tl.load(bt_row_ptr + pages, mask=page_mask, other=0).to(tl.int64)
    return phys[:, None] * stride_b + slot[None, :] * stride_o + kvh * stride_h, t_mask


@triton.jit
def _attend_tile(q, qsum, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_row_ptr,
                 n0, n_lo, n_end, allowed, offs_d, d_mask, kvh,
                 stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, qk_scale, cap_log2e,
                 QUANT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    """One online-softmax step over keys ``max(n0, n_lo) .. min(n0 + BLOCK_N, n_end)`` (others are not loaded:
    with a window, the blocks before ``n_lo`` may be gone); ``allowed`` [ROWS, BLOCK_N] masks scores. Scores in log2 units: ``s * qk_scale``, or with ``SOFTCAP`` ``tanh(s * qk_scale) * cap_log2e``
    (then ``qk_scale = scale / softcap``, ``cap_log2e = softcap * log2(e)``). ``BLOCK_SIZE`` is a constexpr: a
    run-time divisor costs ~20 instructions per token. ``WINDOW`` and ``SOFTCAP`` are constexprs too: a model
    without them compiles the code it did before they existed (the fp16 prefill tile at head_dim 128 sits at
    sm_86's 255 registers)."""
    if QUANT and BLOCK_N % BLOCK_SIZE == 0:
        # INT8, whole pages (n0 is a multiple of BLOCK_N): K/V load as [pages, BLOCK_SIZE, D] tiles
        # reshaped to [BLOCK_N, D]. Besides one block-table read per page, this makes Triton convert the
        # codes in the registers that loaded them and pass fp16 to the tensor cores through ldmatrix; from
        # a flat [BLOCK_N, D] gather it read the V operand out of shared memory byte by byte (64 LDS.U8
        # per thread and step; sm_90 loop 1,377 -> 908 instructions, 194 -> 127 registers, with the
        # constexpr block size; bench/results/sass_stats_sm90*.json). An fp16 cache keeps the flat
        # gather: there V stays on the asynchronous copy path (cp.async) the paged tile takes it off.
        row, t_mask = _gather_pages(bt_row_ptr, n0, n_lo, n_end, kvh, stride_cb, stride_co, stride_ch, BLOCK_N,
                                    BLOCK_SIZE, WINDOW)
        kv_mask = t_mask[:, :, None] & d_mask[None, None, :]
        k = tl.reshape(tl.load(kc_ptr + row[:, :, None] + offs_d[None, None, :], mask=kv_mask, other=0),
                       (BLOCK_N, BLOCK_D))
        v = tl.reshape(tl.load(vc_ptr + row[:, :, None] + offs_d[None, None, :], mask=kv_mask, other=0),
                       (BLOCK_N, BLOCK_D))
        srow, _ = _gather_pages(bt_row_ptr, n0, n_lo, n_end, kvh, stride_sb, stride_so, stride_sh, BLOCK_N,
                                BLOCK_SIZE, WINDOW)
        ks = tl.reshape(tl.load(ks_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
        kz = tl.reshape(tl.load(kz_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
        vs = tl.reshape(tl.load(vs_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
        vz = tl.reshape(tl.load(vz_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
    else:
        row, t_mask = _gather_rows(bt_row_ptr, n0, n_lo, n_end, kvh, stride_cb, stride_co, stride_ch, BLOCK_N,
                                   BLOCK_SIZE, WINDOW)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(vc_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        if QUANT:
            srow, _ = _gather_rows(bt_row_ptr, n0, n_lo, n_end, kvh, stride_sb, stride_so, stride_sh, BLOCK_N,
                                   BLOCK_SIZE, WINDOW)
            ks = tl.load(ks_ptr + srow, mask=t_mask, other=0.0).to(tl.float32)
            kz = tl.load(kz_ptr + srow, mask=t_mask, other=0.0).to(tl.float32)
            vs = tl.load(vs_ptr + srow, mask=t_mask, other=0.0).to(tl.float32)
            vz = tl.load(vz_ptr + srow, mask=t_mask, other=0.0).to(tl.float32)
    if QUANT:
        k = _int8_to_f16(k)
        v = _int8_to_f16(v)
    s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [ROWS, BLOCK_N] fp32
    if QUANT:
        s = s * ks[None, :] + qsum[:, None] * kz[None, :]
    s = s * qk_scale
    if SOFTCAP:
        s = tanh_f32(s) * cap_log2e
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if WINDOW:
        # A row with nothing visible yet (a window can mask a whole tile for it) keeps m = -inf; shifting by 0
        # instead keeps its alpha and p at 0 (not exp2(-inf + inf) = NaN). Without a window every row sees
        # key 0 in the first tile.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if QUANT:
        acc = tl.dot((p * vs[None, :]).to(q.dtype), v.to(q.dtype), acc)
        acc += tl.sum(p * vz[None, :], axis=1)[:, None]
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc, m_new, l_i


@triton.jit
def _partition_size(ctx, partition_size, num_splits, TILE: tl.constexpr):
    """Tokens per decode partition of a ``ctx``-token sequence: ``partition_size``, or when that is 0 the
    sequence's real context spread over ``num_splits`` partitions of whole ``TILE``-key tiles."""
    adaptive = tl.cdiv(tl.cdiv(ctx, num_splits), TILE) * TILE
    return tl.where(partition_size == 0, adaptive, partition_size)


@triton.jit
def paged_decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, cap_log2e, window, head_dim, partition_size, max_splits,
    stride_qs, stride_qh, stride_os, stride_oh, stride_bts,
    stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    # The keys the query (at ctx - 1) sees: [win_lo, ctx); the loop starts at the tile holding win_lo.
    if WINDOW:
        win_lo = tl.maximum(ctx - window, 0)
        lo = (win_lo // BLOCK_N) * BLOCK_N
    else:
        win_lo = 0
        lo = 0
    partition_size = _partition_size(ctx - lo, partition_size, max_splits, BLOCK_N)
    start = lo + part * partition_size
    if start >= ctx:
        return  # the reduction reads only the partitions that hold tokens
    end = tl.minimum(start + partition_size, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    heads = kvh * GROUP + offs_g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)  # CPU interpreter only: its bf16 tl.dot returns garbage (Triton 3.9)
    qsum = tl.sum(q.to(tl.float32), axis=1)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bts
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        if WINDOW:
            t_mask = t_mask & (tok >= win_lo)
        allowed = (offs_g[:, None] >= 0) & t_mask[None, :]
        acc, m_i, l_i = _attend_tile(q, qsum, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                                     bt_row_ptr, n0, win_lo, end, allowed, offs_d, d_mask, kvh,
                                     stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, qk_scale,
                                     cap_log2e, QUANT, BLOCK_SIZE, BLOCK_N, BLOCK_D, SOFTCAP, WINDOW)
    if SPLIT:
        # partials: acc [num_seqs, num_heads, max_splits, BLOCK_D], (m, l) [num_seqs, num_heads, max_splits, 2]
        base = (seq * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * max_splits + part
        tl.store(part_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + base * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=g_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def paged_decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, ctx_ptr, out_ptr, window, head_dim, partition_size, max_splits, stride_os, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    WINDOW: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    span = ctx
    if WINDOW:  # the partitions cover [lo, ctx), as in the decode kernel
        span = ctx - (tl.maximum(ctx - window, 0) // TILE) * TILE
    n_parts = tl.cdiv(span, _partition_size(span, partition_size, max_splits, TILE))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < n_parts
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * max_splits + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + base * 2, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + base * 2 + 1, mask=s_mask, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # 0 for empty partitions
    w = tl.where(s_mask, w, 0.0)
    # lanes past head_dim were never written (torch.empty): masked, not read
    acc = tl.load(part_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(w * l_part, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


@triton.jit
def paged_prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, cu_ptr, ctx_ptr, bt_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, out_ptr,
    qk_scale, cap_log2e, window, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bts,
    stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    seq = tl.program_id(0)
    qb = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if qb * BLOCK_M >= q_len:
        return  # the grid covers the longest possible sequence; most programs of short ones exit here
    ctx = tl.load(ctx_ptr + seq)
    prefix = ctx - q_len
    kvh = head // GROUP
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_mask = m_mask[:, None] & d_mask[None, :]
    tok_q = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok_q[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    qsum = tl.sum(q.to(tl.float32), axis=1)
    pos = prefix + offs_m  # absolute position of each query: it sees keys 0..pos
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bts
    hi = tl.minimum(ctx, prefix + (qb + 1) * BLOCK_M)
    # With a window, the first key any row of this block sees is its first query's position - window + 1.
    if WINDOW:
        win_lo = tl.maximum(prefix + qb * BLOCK_M - window + 1, 0)
        lo = (win_lo // BLOCK_N) * BLOCK_N
    else:
        win_lo = 0
        lo = 0
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < ctx
        allowed = (tok[None, :] <= pos[:, None]) & t_mask[None, :]
        if WINDOW:
            allowed = allowed & (tok[None, :] > pos[:, None] - window)
        acc, m_i, l_i = _attend_tile(q, qsum, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                                     bt_row_ptr, n0, win_lo, ctx, allowed, offs_d, d_mask, kvh,
                                     stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, qk_scale,
                                     cap_log2e, QUANT, BLOCK_SIZE, BLOCK_N, BLOCK_D, SOFTCAP, WINDOW)
    out = acc / l_i[:, None]
    tl.store(out_ptr + tok_q[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------- launchers


def _check_cache(name: str, q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor) -> int:
    """Validate q and the block tables against ``kv`` (whose own layout :class:`PagedKV` checked); returns the
    GQA group size. Raises ValueError."""
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES or q.stride(2) != 1:
        raise ValueError(f"{name}: q must be float [*, num_heads, head_dim] with stride 1 on head_dim, "
                         f"got {tuple(q.shape)} {q.dtype}")
    if kv.head_dim != q.shape[2]:
        raise ValueError(f"{name}: cache head_dim {kv.head_dim} vs q {q.shape[2]}")
    num_heads, num_kv_heads = q.shape[1], kv.num_kv_heads
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64) or block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables must be int32/int64 [num_seqs, max_num_blocks], row-contiguous")
    check_device(name, q, block_tables, *kv.tensors())
    return num_heads // num_kv_heads


def _scale_args(kv: PagedKV) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The four scale/zero pointers and their shared strides; for a float cache K four times (never read)
    and zero strides."""
    if kv.is_int8:
        return kv.scales, kv.k_scale.stride()
    return (kv.k,) * 4, (0, 0, 0)


LOG2E = 1.4426950408889634


def _score_args(scale: float, softcap: float) -> tuple[float, float, bool]:
    """``(qk_scale, cap_log2e, SOFTCAP)`` for :func:`_attend_tile` (scores in log2 units)."""
    if softcap > 0:
        return scale / softcap, softcap * LOG2E, True
    return scale * LOG2E, 0.0, False


def _check_window(name: str, window: int, softcap: float) -> None:
    if int(window) != window or window < 0 or not softcap >= 0:
        raise ValueError(f"{name}: window must be an int >= 0 (0: none) and softcap >= 0 (0: none), got {window}, "
                         f"{softcap}")


def paged_attention_decode_impl(q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, window: int = 0, softcap: float = 0.0, *,
                                partition_size: int | None = None) -> torch.Tensor:
    """:func:`paged_attention_decode` with the partition size forced (tests, bench)."""
    _check_window("paged_attention_decode", window, softcap)
    group = _check_cache("paged_attention_decode", q, kv, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"paged_attention_decode: block_tables {tuple(block_tables.shape)} / context_lens "
                         f"{tuple(context_lens.shape)} do not match num_seqs={num_seqs}")
    check_device("paged_attention_decode", q, context_lens)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    cfg = attn_config(DECODE_CONFIGS, head_dim)
    block_size = kv.block_size
    max_ctx = block_tables.shape[1] * block_size  # host-side bound: no device sync for max(context_lens)
    if window > 0:  # a windowed query reads at most window + one tile of keys: plan for that span
        max_ctx = min(max_ctx, window + cfg.block_n)
    if partition_size is None:
        num_splits, part = decode_split_plan(num_seqs, kv.num_kv_heads, max_ctx, q.device)
    else:
        if partition_size <= 0 or partition_size % cfg.block_n:
            raise ValueError(f"paged_attention_decode: partition_size {partition_size} must be a positive multiple "
                             f"of {cfg.block_n}")
        num_splits, part = max(1, triton.cdiv(max_ctx, partition_size)), partition_size
    split = num_splits > 1
    if not split:
        part = max(max_ctx, 1)
    block_d = decode_block_d(head_dim)
    if split:  # the workspace attention_plan.decode_workspace_bytes counts
        part_acc = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    (ks, kz, vs, vz), (sb, so, sh) = _scale_args(kv)
    qk_scale, cap_log2e, use_softcap = _score_args(scale, softcap)
    paged_decode_kernel[(num_seqs, kv.num_kv_heads, num_splits)](
        q, kv.k, kv.v, block_tables, context_lens, ks, kz, vs, vz, out, part_acc, part_ml,
        qk_scale, cap_log2e, int(window), head_dim, part, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), sb, so, sh,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        QUANT=kv.is_int8, SPLIT=split, UPCAST_DOT=upcast_dot(q.dtype), BLOCK_SIZE=block_size, SOFTCAP=use_softcap,
        WINDOW=window > 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(q.device),
        **COMPILE_OPTIONS,
    )
    if split:
        paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, context_lens, out, int(window), head_dim, part, num_splits, out.stride(0),
            out.stride(1),
            BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, TILE=cfg.block_n, WINDOW=window > 0,
            num_warps=REDUCE_NUM_WARPS,
            **pdl_launch(q.device), **COMPILE_OPTIONS,
        )
    return out


def paged_attention_decode(q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One new query token per sequence against its cached context (the last ``window`` tokens of it when
    ``window > 0``).

    Args:
        q: float ``[num_seqs, num_heads, head_dim]`` (head_dim <= 256), stride 1 on head_dim.
        kv: the layer's cache (:class:`PagedKV`: float or INT8; INT8 scales/zeros in any strides shared by
            the four, the engine's are head-major on GPUs: see ``KVCacheSpec.allocate``).
        block_tables: int32 ``[num_seqs, max_num_blocks]`` (unused entries -1).
        context_lens: int32 ``[num_seqs]`` tokens in the cache (>= 1), the new one included.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        window: sliding window in tokens (0: none); block-table entries before it are never read.
        softcap: tanh soft-capping of the scaled scores (0: none).
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    return paged_attention_decode_impl(q, kv, block_tables, context_lens, scale, window, softcap)


def paged_attention_prefill(q: torch.Tensor, kv: PagedKV, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of new tokens over cached prefix blocks plus themselves (already stored).

    Args:
        q: float ``[num_tokens, num_heads, head_dim]``, sequences concatenated.
        kv: the layer's cache, as :func:`paged_attention_decode`.
        cu_seqlens_q: int32 ``[num_seqs + 1]`` offsets of each sequence's new tokens in ``q``.
        context_lens: int32 ``[num_seqs]`` total tokens in the cache per sequence (prefix + new).
        block_tables: int32 ``[num_seqs, max_num_blocks]``.
        scale: softmax scale.
        window, softcap: as :func:`paged_attention_decode`.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    _check_window("paged_attention_prefill", window, softcap)
    group = _check_cache("paged_attention_prefill", q, kv, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.numel() - 1
    if cu_seqlens_q.dim() != 1 or num_seqs < 0 or context_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_attention_prefill: cu_seqlens_q {tuple(cu_seqlens_q.shape)}, context_lens "
                         f"{tuple(context_lens.shape)}, block_tables {tuple(block_tables.shape)} disagree on num_seqs")
    check_device("paged_attention_prefill", q, cu_seqlens_q, context_lens)
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs <= 0:
        return out
    cfg = prefill_config(head_dim, kv.is_int8, window > 0)
    (ks, kz, vs, vz), (sb, so, sh) = _scale_args(kv)
    grid = (num_seqs, triton.cdiv(num_tokens, PREFILL_BLOCK_M), num_heads)
    qk_scale, cap_log2e, use_softcap = _score_args(scale, softcap)
    paged_prefill_kernel[grid](
        q, kv.k, kv.v, cu_seqlens_q, context_lens, block_tables, ks, kz, vs, vz, out,
        qk_scale, cap_log2e, int(window), head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), sb, so, sh,
        GROUP=group, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_D=max(16, next_pow2(head_dim)),
        QUANT=kv.is_int8, UPCAST_DOT=upcast_dot(q.dtype), BLOCK_SIZE=kv.block_size, SOFTCAP=use_softcap,
        WINDOW=window > 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(q.device),
        **COMPILE_OPTIONS,
    )
    return out
