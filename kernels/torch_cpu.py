"""The ``torch_cpu`` backend: the CPU engine's ops in PyTorch, written for speed on a CPU.

The same functions and signatures as the Triton launchers and the naive twins in ``reference.py``
(``backends.OP_NAMES``), and the same results up to summation order (``tests/kernels/test_torch_cpu.py``
holds them to the reference). What makes it fast:

* attention goes through torch's fused ``scaled_dot_product_attention`` (``sdpa.py``) and gathers whole
  KV blocks (a 2-D ``index_select`` of block rows) rather than single tokens;
* decode sorts the batch by context length and cuts it into groups, each one gather + one SDPA call,
  planned once per step and reused by every layer (:func:`_decode_plan`);
* RMSNorm, RoPE + KV store and SiLU·mul are the fewest torch calls that give the reference's result, with
  what every layer of a step shares computed once per step (``cpu_fused.py``).

The GEMM ops (4-/8-bit), GeGLU and the MoE experts' reference are the reference's own or ``moe_cpu.py``'s: the
CPU engine's low-bit layers call the prepared form of ``cpu_lowbit.py`` instead (their weights converted once,
at load). Works on any device, but the engine uses it on CPU only (``lightinfer.layers.ops``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_native
from .cpu_fused import (
    apply_rotary,
    fused_add_rms_norm,
    qk_rms_norm_,
    rms_norm,
    rope_store_kvcache,
    rotary_qk,
    silu_and_mul,
    store_kvcache,
)
from .moe_cpu import fused_moe
from .paged_kv import PagedKV
from .reference import dequantize_kv_int8, gelu_tanh_and_mul, w4a16_gemm, w8a16_gemm, window_start
from .sdpa import attend, varlen_causal_attention

__all__ = ["apply_rotary", "fused_add_rms_norm", "fused_moe", "gather_blocks", "gather_kv", "gelu_tanh_and_mul",
           "paged_attention_decode", "paged_attention_prefill", "qk_rms_norm_", "rms_norm", "rope_store_kvcache", "rotary_qk", "silu_and_mul",
           "store_kvcache", "varlen_causal_attention", "w4a16_gemm", "w8a16_gemm"]


# ----------------------------------------------------------------------------- KV cache


def _gather_rows(t: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``t [num_blocks_total, block_size, ...]`` -> ``[num_seqs, len(blocks) // num_seqs * block_size, ...]``."""
    # index_select on a 2-D [blocks, bytes per block] view copies whole rows at memcpy speed; on
    # the 4-D cache it is ~4x slower (measured on CPU).
    picked = t.reshape(t.shape[0], -1).index_select(0, blocks)
    return picked.view(num_seqs, -1, *t.shape[2:])


def gather_blocks(kv: PagedKV, blocks: torch.Tensor, num_seqs: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Read whole cache blocks: int64 ``blocks [num_seqs * n]`` (each sequence's first ``n`` block ids, in
    order) -> K and V ``[num_seqs, n * block_size, num_kv_heads, head_dim]`` in ``dtype`` (INT8 dequantized)."""
    out = []
    for cache, scale, zero in ((kv.k, kv.k_scale, kv.k_zero), (kv.v, kv.v_scale, kv.v_zero)):
        x = _gather_rows(cache, blocks, num_seqs)
        if kv.is_int8:
            x = dequantize_kv_int8(x, _gather_rows(scale, blocks, num_seqs), _gather_rows(zero, blocks, num_seqs),
                                   dtype)
        out.append(x if x.dtype == dtype else x.to(dtype))
    return out[0], out[1]


def gather_kv(kv: PagedKV, block_table: torch.Tensor, length: int,
              dtype: torch.dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``start .. length - 1`` of one sequence (``start`` a multiple of the block size): K and V
    ``[length - start, num_kv_heads, head_dim]`` in ``dtype``."""
    first, num_blocks = start // kv.block_size, (length + kv.block_size - 1) // kv.block_size
    k, v = gather_blocks(kv, block_table[first:num_blocks].long(), 1, dtype)
    return k[0, : length - start], v[0, : length - start]


# ----------------------------------------------------------------------------- attention

# Decode sequences are taken in order of context length and cut into groups, each padded to
# its own longest context and run as one gather + one SDPA call. Measured on 2 CPU cores
# (SmolLM2 shapes): a group costs ~55 us of fixed overhead plus ~0.14 us per padded token while
# its gathered K stays near 12 MiB, twice that per token beyond (cache misses, page faults). So
# a sequence starts a new group when joining would add more than DECODE_PAD_TOKENS of padding
# (about half a group's overhead: padding also costs cache space) or push the group's fp32 K
# past DECODE_GROUP_BYTES.
DECODE_PAD_TOKENS = 256
DECODE_GROUP_BYTES = 12 * 2**20


@dataclass
class _DecodeGroup:
    seqs: torch.Tensor | slice  # rows of the batch in this group (a slice when already sorted)
    blocks: torch.Tensor  # int64 [n * num_blocks] block ids to gather (padding reads block 0)
    num_blocks: int
    mask: torch.Tensor  # bool [n, 1, 1, num_blocks * block_size], True = attend


# Every layer of a step calls the decode with the same block_tables / context_lens tensors (one pair per
# KV-cache group: a model with sliding-window layers has two); the grouping is computed once per step and
# group and reused. The key holds the tensor objects (so their identity cannot be recycled while cached)
# and their in-place version counters.
_DECODE_PLAN_SLOTS = 4
_decode_plan_cache: list[tuple[torch.Tensor, torch.Tensor, tuple, list[_DecodeGroup]]] = []


def _decode_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
    window: int = 0,
) -> list[_DecodeGroup]:
    # inference-mode tensors (the engine's) keep no version counter; they are made fresh each step
    versions = tuple(-1 if t.is_inference() else t._version for t in (block_tables, context_lens))
    values = (*versions, block_size, num_kv_heads, head_dim, window)
    for cached in _decode_plan_cache:
        if cached[0] is block_tables and cached[1] is context_lens and cached[2] == values:
            return cached[3]
    lens = context_lens.long()
    # With a window, only the blocks holding the last `window` tokens are gathered: from block `first`.
    first = ((lens - window).clamp(min=0) // block_size) if window > 0 else torch.zeros_like(lens)
    spans = lens - first * block_size  # tokens gathered per sequence
    # The engine lays decodes out sorted by length, so groups are contiguous slices (views, no
    # index copies); other callers get an argsort.
    in_order = bool((spans[1:] >= spans[:-1]).all())
    order = None if in_order else torch.argsort(spans)
    sorted_lens = (spans if order is None else spans[order]).tolist()
    max_tokens = max(1, DECODE_GROUP_BYTES // (num_kv_heads * head_dim * 4))
    bounds, real = [0], sorted_lens[0] if sorted_lens else 0
    for j in range(1, len(sorted_lens)):
        size, length = j - bounds[-1] + 1, sorted_lens[j]  # the group if j joins; j is its longest
        if size * length - (real + length) > DECODE_PAD_TOKENS or size * length > max_tokens:
            bounds.append(j)
            real = length
        else:
            real += length
    bounds.append(len(sorted_lens))
    groups = []
    for start, end in itertools.pairwise(bounds):
        idx = slice(start, end) if order is None else order[start:end]
        num_blocks = (int(spans[idx].max()) + block_size - 1) // block_size
        tok = torch.arange(num_blocks * block_size, device=lens.device)
        if window > 0:
            cols = (first[idx].unsqueeze(1) + torch.arange(num_blocks, device=lens.device)).clamp(
                max=block_tables.shape[1] - 1)
            blocks = block_tables[idx].long().gather(1, cols).clamp(min=0).flatten()
            pos = first[idx].unsqueeze(1) * block_size + tok  # absolute position of each gathered token
            mask = (pos < lens[idx].unsqueeze(1)) & (pos >= lens[idx].unsqueeze(1) - window)
        else:
            blocks = block_tables[idx, :num_blocks].long().clamp(min=0).flatten()
            mask = tok < lens[idx].unsqueeze(1)
        groups.append(_DecodeGroup(idx, blocks, num_blocks, mask[:, None, None, :]))
    _decode_plan_cache.insert(0, (block_tables, context_lens, values, groups))
    del _decode_plan_cache[_DECODE_PLAN_SLOTS:]
    return groups


def paged_attention_decode(q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One new query token per sequence against its cached context (its last ``window`` tokens when
    ``window > 0``; ``softcap > 0``: tanh-capped scores, Gemma 2).

    Sequences are sorted by gathered length and cut into groups (see :data:`DECODE_PAD_TOKENS`); each
    group gathers whole blocks (with a window, only those it reaches), pads to its longest context, masks
    the padding and runs one ``scaled_dot_product_attention`` (fp32; soft-capped scores explicitly). GQA:
    the ``H // Hkv`` query heads of a KV head ride as that head's query rows, so K/V are never repeated.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        kv: the layer's cache.
        block_tables: int32 ``[num_seqs, max_num_blocks]`` (unused entries -1).
        context_lens: int32 ``[num_seqs]`` tokens in the cache, the new one included.
        scale: softmax scale.
        window: sliding window in tokens, 0 = none. softcap: 0 = none.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    """
    if window <= 0 and softcap <= 0:
        native = cpu_native.attend_decode(q, kv, block_tables, context_lens, scale)
        if native is not None:
            return native
    else:  # the C op has neither: said, so that a recorded step names it when it refuses
        cpu_native.declined("attend_decode", "a sliding window" if window > 0 else "soft-capped scores")
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv.num_kv_heads
    groups = _decode_plan(block_tables, context_lens, kv.block_size, num_kv_heads, head_dim, window)
    # one group of the whole batch in order (a slice): its output is the result, no scatter
    out = None if len(groups) == 1 and isinstance(groups[0].seqs, slice) else torch.empty_like(q)
    for g in groups:
        n = g.blocks.numel() // g.num_blocks
        k, v = gather_blocks(kv, g.blocks, n, torch.float32)
        qf = q if out is None else q[g.seqs]
        qf = (qf if qf.dtype == torch.float32 else qf.to(torch.float32)).reshape(n, num_kv_heads,
                                                                                 num_heads // num_kv_heads, head_dim)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [n, Hkv, L, D]
        if softcap > 0:
            s = torch.tanh(qf @ kt.transpose(-1, -2) * (scale / softcap)) * softcap
            o = torch.softmax(s.masked_fill(~g.mask, float("-inf")), dim=-1) @ vt
        else:
            o = F.scaled_dot_product_attention(qf, kt, vt, attn_mask=g.mask, scale=scale)
        o = o.reshape(n, num_heads, head_dim)
        if o.dtype != q.dtype:
            o = o.to(q.dtype)
        if out is None:
            return o
        out[g.seqs] = o
    return out


def paged_attention_prefill(q: torch.Tensor, kv: PagedKV, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of new tokens over cached prefix blocks plus themselves (already stored): one
    gather of whole blocks (with a window, from the block holding the first visible key) and one SDPA call
    per sequence.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, sequences concatenated.
        kv: the layer's cache.
        cu_seqlens_q: int32 ``[num_seqs + 1]`` offsets of each sequence's new tokens in ``q``.
        context_lens: int32 ``[num_seqs]`` total tokens in the cache per sequence (prefix + new).
        block_tables: int32 ``[num_seqs, max_num_blocks]``.
        scale: softmax scale.
        window, softcap: as :func:`paged_attention_decode`.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for i, n in enumerate(context_lens.tolist()):
        a, b = bounds[i], bounds[i + 1]
        lo = (window_start(n - (b - a), window) // kv.block_size) * kv.block_size
        k, v = gather_kv(kv, block_tables[i], n, q.dtype, start=lo)
        out[a:b] = attend(q[a:b], k, v, scale, causal_offset=n - (b - a) - lo, window=window, softcap=softcap)
    return out
