"""The ``reference`` backend: naive plain-PyTorch twins of every op, the oracle the kernels are tested against.

Each function here states what an op computes in the most direct PyTorch that does it: token-by-token
cache indexing, attention as explicit scores, mask and softmax in fp32, one sequence at a time. No
caches, no device branches, no speed tricks: the ``triton`` and ``torch_cpu`` backends (same names and
signatures, ``backends.OP_NAMES``) are held to these results by the tests. Runs on any device.

Layouts: the W4 run-time weight layout is ``w4_layout.py``'s (its helpers are re-exported here, so this
module is also the oracle of the format); the paged KV cache is ``paged_kv.py``'s :class:`PagedKV`.
"""

from __future__ import annotations

import itertools

import torch

from .moe import ExpertWeights, check_moe_args
from .paged_kv import PagedKV
from .split_k import SplitKPartials
from .w4_layout import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    check_integer_zeros,
    dequantize_w4,
    pack_awq,
    pack_int4_rows,
    repack_awq_to_runtime,
    unpack_awq,
    unpack_int4_rows,
)

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "apply_rotary",
    "attend",
    "dequantize_kv_int8",
    "dequantize_w4",
    "dequantize_w4_dm16",
    "fused_add_rms_norm",
    "fused_moe",
    "gather_kv",
    "gelu_tanh_and_mul",
    "pack_awq",
    "pack_int4_rows",
    "paged_attention_decode",
    "paged_attention_prefill",
    "quantize_act",
    "quantize_kv_int8",
    "repack_awq_to_runtime",
    "rms_norm",
    "rope_store_kvcache",
    "rotary_qk",
    "silu_and_mul",
    "store_kvcache",
    "unpack_awq",
    "unpack_int4_rows",
    "varlen_causal_attention",
    "w4_act_gemm",
    "w4a16_gemm",
    "w8_rows_gemm",
    "window_start",
]


# ----------------------------------------------------------------------------- W4A16


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    defer_reduce: bool = False,
    integer_zeros: bool = False,
) -> torch.Tensor:
    """``y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias)``, accumulated in fp32, returned in ``x.dtype``.

    ``defer_reduce`` is accepted for the shared signature; K is never split here, so y is always a tensor.
    ``integer_zeros`` changes nothing here (every zero point is subtracted in fp32) but is held to account:
    the Triton kernels take a cheaper decode on that promise, which would round a fractional zero point.

    Raises:
        ValueError: ``integer_zeros=True`` and a zero point with a fraction.
    """
    if integer_zeros:
        check_integer_zeros(zeros)
    w = dequantize_w4(qweight, scales, zeros).to(torch.float32)  # [N, K]
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def quantize_act(x: torch.Tensor, bits: int = 8, block: int = 32) -> torch.Tensor:
    """``x [..., K]`` with each block of ``block`` values along K rounded to integer steps of
    ``max|x| / (2^(bits-1) - 1)`` (symmetric, round half to even: llama.cpp's Q8 activations for ``bits`` 8),
    returned dequantized in fp32."""
    xb = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    d = xb.abs().amax(-1, keepdim=True) / float(2 ** (bits - 1) - 1)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(x.shape)


def dequantize_w4_dm16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` the CPU's C layout holds for a W4 run-time tensor: ``w = d q + m`` per group
    with ``d = s`` and ``m = -z s`` each rounded to fp16 (exact for GGUF's and AWQ's fp16 scales; the offsets of
    integer zeros move by at most 2^-12 of a quantization step per unit of z). ``qweight`` int32
    ``[N, K // 8]``, ``scales`` / ``zeros`` ``[K // G, N]``."""
    g = qweight.shape[1] * 8 // scales.shape[0]
    d, m = _dm16(scales, zeros)
    return unpack_int4_rows(qweight).to(torch.float32) * d.repeat_interleave(g, dim=1) + m.repeat_interleave(g, dim=1)


def _dm16(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, m)`` fp32 ``[N, K // G]`` of :func:`dequantize_w4_dm16`: ``s`` and ``-z s`` rounded to fp16."""
    s32 = scales.to(torch.float32).t()
    return s32.half().float(), (-zeros.to(torch.float32).t() * s32).half().float()


def w4_act_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None = None, bits: int = 16) -> torch.Tensor:
    """The CPU's C 4-bit products (``cpu_native.w4_linear``; ``bits`` 16 the default, 8 with
    ``int8_activations``): with ``w = d q + m`` (:func:`dequantize_w4_dm16`),
    ``y = sum_g d_g sum_{k in g} q_k xq_k + sum_g m_g sum_{k in g} x_k``, where ``xq`` is :func:`quantize_act`
    of x with ``bits`` and the offset term takes the exact sums of x. fp32 accumulation, returned in
    ``x.dtype``. ``qweight`` int32 ``[N, K // 8]``, ``scales`` / ``zeros`` ``[K // G, N]``."""
    k = qweight.shape[1] * 8
    g = k // scales.shape[0]
    q = unpack_int4_rows(qweight).to(torch.float32)  # [N, K]
    s, m = _dm16(scales, zeros)
    xf = x.to(torch.float32)
    y = quantize_act(xf, bits) @ (q * s.repeat_interleave(g, dim=1)).t()
    y = y + xf.reshape(*x.shape[:-1], k // g, g).sum(-1) @ m.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def w8_rows_gemm(x: torch.Tensor, qweight: torch.Tensor, row_scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU's C 8-bit product with one scale per row (``cpu_native.w8_linear``): :func:`quantize_act` of x
    with 16 bits and one step per row, times ``row_scales[:, None] * qweight`` (int8 ``[N, K]``, scales ``[N]``),
    fp32 sums, returned in ``x.dtype``."""
    xq = quantize_act(x, bits=16, block=x.shape[-1])
    y = xq @ (qweight.to(torch.float32) * row_scales.to(torch.float32).unsqueeze(1)).t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- KV cache


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row asymmetric INT8 over the last dim.

    Args:
        x: float ``[..., head_dim]``.
    Returns:
        ``(q int8 [..., head_dim], scale fp16 [...], zero fp16 [...])`` with
        ``x ~= q * scale + zero``. Constant rows get ``scale`` 1 (their ``q`` is then
        exact up to the fp16 rounding of ``zero``).
    """
    xf = x.to(torch.float32)
    lo = xf.amin(-1)
    hi = xf.amax(-1)
    scale = (hi - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(torch.float16).to(torch.float32)  # quantize against the stored value
    zero = (lo + 128.0 * scale).to(torch.float16).to(torch.float32)
    q = torch.clamp(torch.round((xf - zero.unsqueeze(-1)) / scale.unsqueeze(-1)), -128, 127).to(torch.int8)
    return q, scale.to(torch.float16), zero.to(torch.float16)


def dequantize_kv_int8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_int8`: ``q [..., D]``, ``scale/zero [...]`` -> ``dtype [..., D]``."""
    out = q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1) + zero.to(torch.float32).unsqueeze(-1)
    return out.to(dtype)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slots of -1 are padding and skipped.
    An INT8 cache stores :func:`quantize_kv_int8` of each token and head, and its scale and zero.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // kv.block_size, slots % kv.block_size
    key, value = key[keep], value[keep]
    if kv.is_int8:
        qk, sk, zk = quantize_kv_int8(key)
        qv, sv, zv = quantize_kv_int8(value)
        for cache, x in zip((kv.k, kv.v, *kv.scales), (qk, qv, sk, zk, sv, zv)):
            cache[blk, off] = x
    else:
        kv.k[blk, off] = key.to(kv.dtype)
        kv.v[blk, off] = value.to(kv.dtype)


def gather_kv(kv: PagedKV, block_table: torch.Tensor, length: int,
              dtype: torch.dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``start .. length - 1`` of one sequence, read token by token through its ``block_table``:
    K and V ``[length - start, num_kv_heads, head_dim]`` in ``dtype`` (INT8 dequantized)."""
    pos = torch.arange(start, length, device=block_table.device)
    blk, off = block_table[pos // kv.block_size].long(), pos % kv.block_size
    if kv.is_int8:
        return (dequantize_kv_int8(kv.k[blk, off], kv.k_scale[blk, off], kv.k_zero[blk, off], dtype),
                dequantize_kv_int8(kv.v[blk, off], kv.v_scale[blk, off], kv.v_zero[blk, off], dtype))
    return kv.k[blk, off].to(dtype), kv.v[blk, off].to(dtype)


# ----------------------------------------------------------------------------- attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int, window: int = 0,
           softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of one sequence in fp32: q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]`` (each KV head serves
    ``H // Hkv`` query heads); query i sees keys ``0 .. causal_offset + i``, and with ``window > 0`` only the last
    ``window`` of them (keys ``> causal_offset + i - window``). ``softcap > 0`` caps the scaled scores:
    ``softcap * tanh(s / softcap)`` (Gemma 2). Returns ``[Lq, H, D]`` in ``q.dtype``."""
    group = q.shape[1] // k.shape[1]
    kf = k.to(torch.float32).repeat_interleave(group, dim=1)
    vf = v.to(torch.float32).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), kf) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    key = torch.arange(k.shape[0], device=q.device)[None, :]
    last = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
    visible = key <= last
    if window > 0:
        visible &= key > last - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def window_start(first_query_pos: int, window: int) -> int:
    """The first key position a query at ``first_query_pos`` (or any later one) can see: 0 without a window."""
    return max(0, first_query_pos - window + 1) if window > 0 else 0


def paged_attention_decode(q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One new query token per sequence against its cached context.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        kv: the layer's cache.
        block_tables: int32 ``[num_seqs, max_num_blocks]`` (unused entries -1; with a window, entries of
            blocks wholly before it may be -1 too: they are never read).
        context_lens: int32 ``[num_seqs]`` tokens in the cache, the new one included.
        scale: softmax scale.
        window: sliding-window size (the query sees the last ``window`` tokens); 0 = the whole context.
        softcap: tanh soft-capping of the scaled scores (Gemma 2); 0 = none.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens.tolist()):
        lo = window_start(n - 1, window)
        k, v = gather_kv(kv, block_tables[i], n, torch.float32, start=lo)
        out[i] = attend(q[i:i + 1], k, v, scale, causal_offset=n - 1 - lo, window=window, softcap=softcap)[0]
    return out


def paged_attention_prefill(q: torch.Tensor, kv: PagedKV, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of new tokens over cached prefix blocks plus themselves (already stored).

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
        lo = window_start(n - (b - a), window)
        k, v = gather_kv(kv, block_tables[i], n, torch.float32, start=lo)
        out[a:b] = attend(q[a:b], k, v, scale, causal_offset=n - (b - a) - lo, window=window, softcap=softcap)
    return out


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention without a cache within each sequence of ``cu_seqlens`` (int32 ``[num_seqs + 1]``):
    q ``[T, H, D]``, k/v ``[T, Hkv, D]`` -> ``[T, H, D]`` in ``q.dtype``; ``window``/``softcap`` as
    :func:`paged_attention_decode`."""
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(cu_seqlens.tolist()):
        out[a:b] = attend(q[a:b], k[a:b], v[a:b], scale, causal_offset=0, window=window, softcap=softcap)
    return out


# ----------------------------------------------------------------------------- norm / rope / act


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim, computed in fp32, returned in ``x.dtype``."""
    xf = x.to(torch.float32)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.to(torch.float32)).to(x.dtype)


def qk_rms_norm_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float) -> bool:
    """The per-head q/k RMSNorms (Qwen3, Gemma 3) in place on a fused projection's ``qkv [T, (H + 2 Hkv) * D]``:
    each q head :func:`rms_norm`-ed with ``q_weight [D]``, each k head with ``k_weight``; v untouched. Returns
    whether it normalized: True here; a backend returns False where the model should norm the split heads
    itself (``LlamaAttention.forward``), as the GPU does with its own kernels."""
    q, k = qk_heads(qkv, num_heads, num_kv_heads, q_weight.shape[-1])
    q.copy_(rms_norm(q, q_weight, eps))
    k.copy_(rms_norm(k, k_weight, eps))
    return True


def qk_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a fused projection's ``qkv [T, (H + 2 Hkv) * D]``: q ``[T, H, D]`` and k ``[T, Hkv, D]``."""
    q = qkv[:, : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].unflatten(-1, (num_kv_heads, head_dim))
    return q, k


def fused_add_rms_norm(
    x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; returns ``(rms_norm(residual), residual)``. ``x`` may be a GEMM's
    unreduced :class:`SplitKPartials`."""
    if isinstance(x, SplitKPartials):
        x = x.reduced()
    residual = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    return rms_norm(residual, weight, eps), residual


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, HF Llama convention) of the first ``R = 2 * cos.shape[-1]`` dims of each
    head (R < head_dim: partial rotation, the other dims pass unchanged).

    Args:
        x: ``[num_tokens, num_heads, head_dim]``.
        cos, sin: ``[num_tokens, R // 2]`` (already gathered at the tokens' positions).
    """
    half = cos.shape[-1]
    xf = x.to(torch.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    c = cos.to(torch.float32).unsqueeze(1)
    s = sin.to(torch.float32).unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)


def rotary_qk(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` with ``cos_cache``/``sin_cache``
    ``[max_position, R // 2]`` (R <= D rotated dims) gathered at ``positions [T]``."""
    cos, sin = cos_cache[positions], sin_cache[positions]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


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
    """A fused qkv projection's output ``[T, (Hq + 2 Hk) D]`` (or its split-K partials; D = ``kv.head_dim``): q
    and k rotated (:func:`rotary_qk`), k and v written at ``slot_mapping`` (:func:`store_kvcache`); returns q
    ``[T, Hq, D]``."""
    if isinstance(qkv, SplitKPartials):
        qkv = qkv.reduced()
    t, d = qkv.shape[0], kv.head_dim
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = rotary_qk(positions, q.reshape(t, num_heads, d), k.reshape(t, num_kv_heads, d), cos_cache, sin_cache)
    store_kvcache(k, v.reshape(t, num_kv_heads, d), kv, slot_mapping)
    return q


def silu_and_mul(x: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """``x [..., 2 I]`` (or a GEMM's unreduced :class:`SplitKPartials`) -> ``silu(x[..., :I]) * x[..., I:]``."""
    if isinstance(x, SplitKPartials):
        x = x.reduced()
    half = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :half].float()) * x[..., half:].float()).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """``x [..., 2 I]`` (or a GEMM's unreduced :class:`SplitKPartials`) -> ``gelu_tanh(x[..., :I]) * x[..., I:]``:
    GeGLU with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``), in fp32, returned in ``x.dtype``."""
    if isinstance(x, SplitKPartials):
        x = x.reduced()
    half = x.shape[-1] // 2
    gate = torch.nn.functional.gelu(x[..., :half].float(), approximate="tanh")
    return (gate * x[..., half:].float()).to(x.dtype)


# ----------------------------------------------------------------------------- W8A16
# W8 run-time layout (GGUF Q8_0 / Q6_K / Q5_*, GPTQ 8-bit; ``kernels/w8a16_gemm.py`` is the kernel):
#
#     qweight  int8    [N, K]        row n holds output channel n, one code per byte
#     scales   fp32    [K // G, N]
#     zeros    fp32    [K // G, N]   or None (symmetric: every zero is 0); may be fractional
#     w[k, n] = (q[n, k] - zeros[k // G, n]) * scales[k // G, n]
#
# Scales and zeros stay fp32 whatever the activation dtype: GGUF's products d * sc are exact
# there (an fp16 d times a 6- or 8-bit integer), so the layout adds no rounding of its own.


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """W8 run-time layout (above) -> dense fp32 weight ``[N, K]`` (``nn.Linear`` orientation).

    Args:
        qweight: int8 ``[N, K]``; scales: fp32 ``[K // G, N]``; zeros: fp32 ``[K // G, N]`` or None.
    """
    k = qweight.shape[1]
    group_size = k // scales.shape[0]
    w = qweight.to(torch.float32)  # [N, K]
    if zeros is not None:
        w = w - zeros.t().to(torch.float32).repeat_interleave(group_size, dim=1)
    return w * scales.t().to(torch.float32).repeat_interleave(group_size, dim=1)


def w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias)``, accumulated in fp32, returned in ``x.dtype``."""
    y = x.to(torch.float32) @ dequantize_w8(qweight, scales, zeros).t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- mixture of experts


def fused_moe(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts of a MoE layer on a routed batch: ``sum_j topk_weights[t, j] * E_j(x[t])`` with
    ``E(x) = down(silu(gate(x)) * up(x))`` and ``E_j`` the expert ``topk_ids[t, j]``.

    Naive: a loop over the experts, each on the tokens routed to it, in fp32; the SiLU-and-mul output is
    rounded to ``x.dtype`` (where the kernels keep it between their two GEMMs).

    Args:
        x: ``[T, H]``.
        w13: the experts' gate and up projections, stacked ``[E, 2 I, H]`` (``moe.ExpertWeights``).
        w2: their down projections ``[E, H, I]``.
        topk_weights: float ``[T, top_k]`` routing weights; topk_ids: int ``[T, top_k]`` experts.
    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    t, h, inter = check_moe_args(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    xf = x.to(torch.float32)
    for e in range(w13.num_experts):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        gate_up = xf[tok] @ w13.dense(e).to(torch.float32).t()
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).to(torch.float32)
        y = act @ w2.dense(e).to(torch.float32).t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].to(torch.float32).unsqueeze(1))
    return out.to(x.dtype)
