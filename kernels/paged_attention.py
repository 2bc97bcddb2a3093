"""Paged attention over the (fp16/bf16/fp32 or INT8) KV cache: decode and prefill.

Cache layout: ``reference`` module docstring. INT8 K/V are never dequantized element by element:
with per-token ``k = kq * ks + kz`` and ``v = vq * vs + vz``,

    q . k_n      = ks_n * (q . kq_n) + kz_n * sum(q)        (int8 codes are exact in fp16/bf16)
    sum_n p_n v_n = (p * vs) @ vq + sum_n p_n vz_n

so the tensor cores see the raw codes and the scale/zero cost is per token, not per element.

Decode (one query token per sequence): one program per (sequence, KV head, context partition)
handles all query heads of the GQA group as rows of one ``tl.dot`` tile, so each K/V byte is
read once per group. Contexts longer than ``PARTITION_SIZE`` are split (flash-decoding): each
partition writes an unnormalised partial output with its running max and sum, and a reduction
kernel combines them. Prefill: one program per (sequence, block of new tokens, query head),
causal over the cached prefix plus the new tokens (already stored), all sequences in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    TRITON_DTYPE,
    LaunchSpec,
    check_cache_dtype,
    check_device,
    next_pow2,
    num_sms,
    upcast_dot,
)
from .pdl import pdl_launch, pdl_start

# PROVISIONAL (one H200 run so far): tokens per decode partition. Contexts up to this length run in
# one kernel; longer ones are split and reduced. Small batches use shorter partitions (more programs).
PARTITION_SIZE = 512
MIN_PARTITION_SIZE = 128  # a multiple of every config's block_n
MAX_DECODE_SPLITS = 64  # partitions per sequence at most: the reduction holds [splits, head_dim] in registers


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
# (``python -m lightinfer.kernels.smem_check`` reports registers and spills).
PREFILL_INT8_CONFIGS: list[AttnConfig] = [AttnConfig(128, 32, 4, 2), AttnConfig(256, 16, 8, 2)]
PREFILL_BLOCK_M = 64
REDUCE_NUM_WARPS = 4
HEAD_DIMS = (64, 128, 256)  # head sizes the smem check compiles
GQA_GROUPS = (1, 4, 8)


def _config(configs: list[AttnConfig], head_dim: int) -> AttnConfig:
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
def _gather_rows(bt_row_ptr, n0, n_end, kvh, stride_b, stride_o, stride_h,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Offsets ``[BLOCK_N]`` of keys ``n0 .. n0 + BLOCK_N`` (page ``// BLOCK_SIZE``, slot ``% BLOCK_SIZE``) for
    strides ``(stride_b, stride_o, stride_h)`` of a ``[blocks, block_size, heads, ...]`` tensor, and their mask."""
    tok = n0 + tl.arange(0, BLOCK_N)
    t_mask = tok < n_end
    phys = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    return phys * stride_b + (tok % BLOCK_SIZE) * stride_o + kvh * stride_h, t_mask


@triton.jit
def _gather_pages(bt_row_ptr, n0, n_end, kvh, stride_b, stride_o, stride_h,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """:func:`_gather_rows` shaped ``[BLOCK_N // BLOCK_SIZE, BLOCK_SIZE]`` (``n0`` a multiple of BLOCK_SIZE):
    one block-table read per page, and the slots of a page one strided run."""
    pages = n0 // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
    slot = tl.arange(0, BLOCK_SIZE)
    t_mask = (pages[:, None] * BLOCK_SIZE + slot[None, :]) < n_end
    phys = tl.load(bt_row_ptr + pages, mask=pages * BLOCK_SIZE < n_end, other=0).to(tl.int64)
    return phys[:, None] * stride_b + slot[None, :] * stride_o + kvh * stride_h, t_mask


@triton.jit
def _attend_tile(q, qsum, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_row_ptr,
                 n0, n_end, allowed, offs_d, d_mask, kvh,
                 stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, qk_scale, QUANT: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One online-softmax step over keys ``n0 .. min(n0 + BLOCK_N, n_end)``; ``allowed`` [ROWS, BLOCK_N]
    masks scores. ``BLOCK_SIZE`` is a constexpr: a run-time divisor costs ~20 instructions per token."""
    if QUANT and BLOCK_N % BLOCK_SIZE == 0:
        # INT8, whole pages (n0 is a multiple of BLOCK_N): K/V load as [pages, BLOCK_SIZE, D] tiles
        # reshaped to [BLOCK_N, D]. Besides one block-table read per page, this makes Triton convert the
        # codes in the registers that loaded them and pass fp16 to the tensor cores through ldmatrix; from
        # a flat [BLOCK_N, D] gather it read the V operand out of shared memory byte by byte (64 LDS.U8
        # per thread and step; sm_90 loop 1,377 -> 908 instructions, 194 -> 127 registers, with the
        # constexpr block size; bench/results/sass_stats_sm90*.json). An fp16 cache keeps the flat
        # gather: there V stays on the asynchronous copy path (cp.async) the paged tile takes it off.
        row, t_mask = _gather_pages(bt_row_ptr, n0, n_end, kvh, stride_cb, stride_co, stride_ch, BLOCK_N, BLOCK_SIZE)
        kv_mask = t_mask[:, :, None] & d_mask[None, None, :]
        k = tl.reshape(tl.load(kc_ptr + row[:, :, None] + offs_d[None, None, :], mask=kv_mask, other=0),
                       (BLOCK_N, BLOCK_D))
        v = tl.reshape(tl.load(vc_ptr + row[:, :, None] + offs_d[None, None, :], mask=kv_mask, other=0),
                       (BLOCK_N, BLOCK_D))
        srow, _ = _gather_pages(bt_row_ptr, n0, n_end, kvh, stride_sb, stride_so, stride_sh, BLOCK_N, BLOCK_SIZE)
        ks = tl.reshape(tl.load(ks_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
        kz = tl.reshape(tl.load(kz_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
        vs = tl.reshape(tl.load(vs_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
        vz = tl.reshape(tl.load(vz_ptr + srow, mask=t_mask, other=0.0), (BLOCK_N,)).to(tl.float32)
    else:
        row, t_mask = _gather_rows(bt_row_ptr, n0, n_end, kvh, stride_cb, stride_co, stride_ch, BLOCK_N, BLOCK_SIZE)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(vc_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        if QUANT:
            srow, _ = _gather_rows(bt_row_ptr, n0, n_end, kvh, stride_sb, stride_so, stride_sh, BLOCK_N, BLOCK_SIZE)
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
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
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
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, head_dim, partition_size, max_splits,
    stride_qs, stride_qh, stride_os, stride_oh, stride_bts,
    stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    partition_size = _partition_size(ctx, partition_size, max_splits, BLOCK_N)
    start = part * partition_size
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
        allowed = (offs_g[:, None] >= 0) & t_mask[None, :]
        acc, m_i, l_i = _attend_tile(q, qsum, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                                     bt_row_ptr, n0, end, allowed, offs_d, d_mask, kvh,
                                     stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, qk_scale, QUANT,
                                     BLOCK_SIZE, BLOCK_N, BLOCK_D)
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
def _decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, ctx_ptr, out_ptr, head_dim, partition_size, max_splits, stride_os, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    n_parts = tl.cdiv(ctx, _partition_size(ctx, partition_size, max_splits, TILE))
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
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, cu_ptr, ctx_ptr, bt_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, out_ptr,
    qk_scale, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bts,
    stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
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
    for n0 in range(0, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < ctx
        allowed = (tok[None, :] <= pos[:, None]) & t_mask[None, :]
        acc, m_i, l_i = _attend_tile(q, qsum, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                                     bt_row_ptr, n0, ctx, allowed, offs_d, d_mask, kvh,
                                     stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, qk_scale, QUANT,
                                     BLOCK_SIZE, BLOCK_N, BLOCK_D)
    out = acc / l_i[:, None]
    tl.store(out_ptr + tok_q[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------- launchers


def _check_cache(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, aux: tuple[torch.Tensor | None, ...]) -> tuple[bool, int]:
    """Validate q/cache/aux; returns ``(quant, group)``. Raises ValueError."""
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES or q.stride(2) != 1:
        raise ValueError(f"{name}: q must be float [*, num_heads, head_dim] with stride 1 on head_dim, "
                         f"got {tuple(q.shape)} {q.dtype}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"{name}: k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] with "
                         f"equal strides, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.stride(3) != 1 or k_cache.shape[3] != q.shape[2] or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: cache head_dim {k_cache.shape[3]} vs q {q.shape[2]}, dtypes {k_cache.dtype}/"
                         f"{v_cache.dtype}, stride on head_dim {k_cache.stride(3)}")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64) or block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables must be int32/int64 [num_seqs, max_num_blocks], row-contiguous")
    quant = check_cache_dtype(name, k_cache, aux)
    check_device(name, q, k_cache, v_cache, block_tables, *(aux if quant else ()))
    return quant, num_heads // num_kv_heads


def decode_split_plan(num_seqs: int, num_kv_heads: int, max_ctx: int, device: torch.device) -> tuple[int, int]:
    """``(num_splits, partition_size)`` of a decode launch; ``partition_size`` 0 = adaptive.

    Small batches (``num_seqs * num_kv_heads`` programs would not give every SM two) split each
    sequence's *real* context, read in the kernel, into ``cdiv(2 SMs, programs)`` (at most
    ``MAX_DECODE_SPLITS``) partitions of whole tiles. ``max_ctx`` (the block-table width) cannot size
    them: inside a CUDA graph it is ``max_model_len``, so fixed partitions derived from it either
    left a 300-token chat on one program per KV head (512-token partitions at batch 1 on
    Llama-2-7B: 32 of 132 SMs busy) or, made small, launched thousands of programs that exit at once.
    Larger batches have parallelism to spare: fixed ``PARTITION_SIZE`` partitions (fewer when
    ``max_ctx`` is short), which only split long contexts.
    """
    programs = max(1, num_seqs * num_kv_heads)
    if programs < 2 * num_sms(device):
        return min(MAX_DECODE_SPLITS, triton.cdiv(2 * num_sms(device), programs)), 0
    ctx = max(max_ctx, 1)
    fewest = triton.cdiv(triton.cdiv(ctx, MAX_DECODE_SPLITS), MIN_PARTITION_SIZE) * MIN_PARTITION_SIZE
    part = max(fewest, min(PARTITION_SIZE, triton.cdiv(ctx, MIN_PARTITION_SIZE) * MIN_PARTITION_SIZE))
    return triton.cdiv(ctx, part), part


def paged_attention_decode_impl(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None, k_zero: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, v_zero: torch.Tensor | None = None, *, partition_size: int | None = None,
) -> torch.Tensor:
    """:func:`paged_attention_decode` with the partition size forced (tests, bench)."""
    aux = (k_scale, k_zero, v_scale, v_zero)
    quant, group = _check_cache("paged_attention_decode", q, k_cache, v_cache, block_tables, aux)
    num_seqs, num_heads, head_dim = q.shape
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"paged_attention_decode: block_tables {tuple(block_tables.shape)} / context_lens "
                         f"{tuple(context_lens.shape)} do not match num_seqs={num_seqs}")
    check_device("paged_attention_decode", q, context_lens)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    cfg = _config(DECODE_CONFIGS, head_dim)
    block_size = k_cache.shape[1]
    max_ctx = block_tables.shape[1] * block_size  # host-side bound: no device sync for max(context_lens)
    if partition_size is None:
        num_splits, part = decode_split_plan(num_seqs, k_cache.shape[2], max_ctx, q.device)
    else:
        if partition_size <= 0 or partition_size % cfg.block_n:
            raise ValueError(f"paged_attention_decode: partition_size {partition_size} must be a positive multiple "
                             f"of {cfg.block_n}")
        num_splits, part = max(1, triton.cdiv(max_ctx, partition_size)), partition_size
    split = num_splits > 1
    if not split:
        part = max(max_ctx, 1)
    block_d = max(16, next_pow2(head_dim))
    if split:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    ks, kz, vs, vz = aux if quant else (k_cache,) * 4
    sb, so, sh = k_scale.stride() if quant else (0, 0, 0)
    log2e = 1.4426950408889634
    _decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, ks, kz, vs, vz, out, part_acc, part_ml,
        scale * log2e, head_dim, part, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), sb, so, sh,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        QUANT=quant, SPLIT=split, UPCAST_DOT=upcast_dot(q.dtype), BLOCK_SIZE=block_size, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_launch(q.device),
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, context_lens, out, head_dim, part, num_splits, out.stride(0), out.stride(1),
            BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, TILE=cfg.block_n, num_warps=REDUCE_NUM_WARPS,
            **pdl_launch(q.device),
        )
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new query token per sequence against its whole cached context.

    Args:
        q: float ``[num_seqs, num_heads, head_dim]`` (head_dim <= 256), stride 1 on head_dim.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float or int8.
        block_tables: int32 ``[num_seqs, max_num_blocks]`` (unused entries -1).
        context_lens: int32 ``[num_seqs]`` tokens in the cache (>= 1), the new one included.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        k_scale, k_zero, v_scale, v_zero: float16 ``[num_blocks, block_size, num_kv_heads]`` for int8,
            any strides shared by the four (the engine's are head-major: see ``KVCacheSpec``).
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    return paged_attention_decode_impl(q, k_cache, v_cache, block_tables, context_lens, scale,
                                       k_scale, k_zero, v_scale, v_zero)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over cached prefix blocks plus themselves (already stored).

    Args:
        q: float ``[num_tokens, num_heads, head_dim]``, sequences concatenated.
        cu_seqlens_q: int32 ``[num_seqs + 1]`` offsets of each sequence's new tokens in ``q``.
        context_lens: int32 ``[num_seqs]`` total tokens in the cache per sequence (prefix + new).
        block_tables: int32 ``[num_seqs, max_num_blocks]``.
        Others as :func:`paged_attention_decode`.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    aux = (k_scale, k_zero, v_scale, v_zero)
    quant, group = _check_cache("paged_attention_prefill", q, k_cache, v_cache, block_tables, aux)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.numel() - 1
    if cu_seqlens_q.dim() != 1 or num_seqs < 0 or context_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_attention_prefill: cu_seqlens_q {tuple(cu_seqlens_q.shape)}, context_lens "
                         f"{tuple(context_lens.shape)}, block_tables {tuple(block_tables.shape)} disagree on num_seqs")
    check_device("paged_attention_prefill", q, cu_seqlens_q, context_lens)
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs <= 0:
        return out
    cfg = _config(PREFILL_INT8_CONFIGS if quant else PREFILL_CONFIGS, head_dim)
    ks, kz, vs, vz = aux if quant else (k_cache,) * 4
    sb, so, sh = k_scale.stride() if quant else (0, 0, 0)
    grid = (num_seqs, triton.cdiv(num_tokens, PREFILL_BLOCK_M), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, ks, kz, vs, vz, out,
        scale * 1.4426950408889634, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), sb, so, sh,
        GROUP=group, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_D=max(16, next_pow2(head_dim)),
        QUANT=quant, UPCAST_DOT=upcast_dot(q.dtype), BLOCK_SIZE=k_cache.shape[1], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_launch(q.device),
    )
    return out


# ----------------------------------------------------------------------------- compile specs


def launch_specs() -> list[LaunchSpec]:
    """Kernel variants for the smem check: fp16 queries, fp16 and int8 caches, head sizes, GQA groups; the
    engine's KV block sizes for int8 caches (their page gather's tile depends on it), 16 for fp16."""
    from lightinfer.config import KV_BLOCK_SIZES  # the block sizes the engine accepts

    specs: list[LaunchSpec] = []
    cache_ints = ["stride_cb", "stride_co", "stride_ch", "stride_sb", "stride_so", "stride_sh"]
    for cache_dt in (torch.float16, torch.int8):
        c = "*" + TRITON_DTYPE[cache_dt]
        quant = cache_dt == torch.int8
        ptrs = {"kc_ptr": c, "vc_ptr": c, "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16", "vz_ptr": "*fp16"}
        for block_size in KV_BLOCK_SIZES if quant else (16,):
            for d in HEAD_DIMS:
                dc = _config(DECODE_CONFIGS, d)
                for group in GQA_GROUPS:
                    for split in (False, True):
                        ce = {"GROUP": group, "BLOCK_G": max(16, next_pow2(group)), "BLOCK_N": dc.block_n,
                              "BLOCK_D": d, "QUANT": quant, "SPLIT": split, "UPCAST_DOT": False,
                              "BLOCK_SIZE": block_size}
                        sig = {"q_ptr": "*fp16", **ptrs, "bt_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*fp16",
                               "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32",
                               **dict.fromkeys(["head_dim", "partition_size", "max_splits", "stride_qs", "stride_qh",
                                                "stride_os", "stride_oh", "stride_bts", *cache_ints], "i32"),
                               **dict.fromkeys(ce, "constexpr")}
                        specs.append(LaunchSpec(f"attn_decode[{cache_dt}]", _decode_kernel, sig, ce, dc.num_warps,
                                                dc.num_stages))
                pc = _config(PREFILL_INT8_CONFIGS if quant else PREFILL_CONFIGS, d)
                ce = {"GROUP": 4, "BLOCK_M": PREFILL_BLOCK_M, "BLOCK_N": pc.block_n, "BLOCK_D": d, "QUANT": quant,
                      "UPCAST_DOT": False, "BLOCK_SIZE": block_size}
                sig = {"q_ptr": "*fp16", **ptrs, "cu_ptr": "*i32", "ctx_ptr": "*i32", "bt_ptr": "*i32",
                       "out_ptr": "*fp16", "qk_scale": "fp32",
                       **dict.fromkeys(["head_dim", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                                        "stride_bts", *cache_ints], "i32"),
                       **dict.fromkeys(ce, "constexpr")}
                specs.append(LaunchSpec(f"attn_prefill[{cache_dt}]", _prefill_kernel, sig, ce, pc.num_warps,
                                        pc.num_stages))
    for d in HEAD_DIMS:
        for bs in (2, 16, MAX_DECODE_SPLITS):
            ce = {"BLOCK_S": bs, "BLOCK_D": d, "TILE": _config(DECODE_CONFIGS, d).block_n}
            sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "ctx_ptr": "*i32", "out_ptr": "*fp16",
                   **dict.fromkeys(["head_dim", "partition_size", "max_splits", "stride_os", "stride_oh"], "i32"),
                   **dict.fromkeys(ce, "constexpr")}
            specs.append(LaunchSpec("attn_decode_reduce", _decode_reduce_kernel, sig, ce, REDUCE_NUM_WARPS, 1))
    return specs
