"""Plain-PyTorch twins of every Triton kernel in this package.

These run on any device (the engine's CPU path uses them) and are the oracle the
kernel tests compare against. They favour clarity, but they are also the CPU engine's
hot path, so attention goes through torch's fused ``scaled_dot_product_attention`` and
gathers whole KV blocks rather than single tokens.

Layouts (see ``../shared/DESIGN.md``, "Formats"):

* W4 run-time layout (converted once at load time from AutoAWQ's disk layout by
  :func:`repack_awq_to_runtime`)::

      qweight  int32   [N, K // 8]   row n holds output channel n; nibble i (bits 4i..4i+3)
                                     of word j is the 4-bit code of input k = 8 j + i
      scales   fp16/bf16 [K // G, N]
      zeros    fp16/bf16 [K // G, N] the integer zero point z, stored as a float
      w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]

  Packing along K keeps each output row contiguous, which is what a GEMV reads.

* Paged KV cache, per layer: ``k_cache``/``v_cache`` ``[num_blocks, block_size,
  num_kv_heads, head_dim]``; slot ``s`` is block ``s // block_size``, offset
  ``s % block_size``. INT8 caches add ``k_scale, k_zero, v_scale, v_zero`` float16
  ``[num_blocks, block_size, num_kv_heads]``: per token and per head, asymmetric,
  ``x ~= q * scale + zero`` with ``q`` in [-128, 127].
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import SplitKPartials

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ "gemm": nibble j of a word holds column AWQ_ORDER[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c lives in nibble AWQ_REVERSE_ORDER[c]


# ----------------------------------------------------------------------------- W4A16


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int32 words along the last dim into 8 natural-order nibbles.

    Args:
        packed: int32 ``[..., C // 8]``.
    Returns:
        uint8-valued int32 ``[..., C]`` where element ``8 j + i`` is nibble ``i`` of word ``j``.
    """
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_int4_rows`: ``[..., C]`` codes 0..15 -> int32 ``[..., C // 8]``."""
    if codes.shape[-1] % 8:
        raise ValueError(f"last dim {codes.shape[-1]} must be a multiple of 8 to pack 4-bit codes")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (c << shifts).sum(-1)
    # Wrap into int32 range (bit 31 set -> negative), the AutoAWQ convention.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ "gemm" int32 ``[R, C // 8]`` -> codes int32 ``[R, C]`` in column order.

    Source: AutoAWQ ``awq/modules/linear/gemm.py`` (order ``[0, 2, 4, 6, 1, 3, 5, 7]``).
    """
    nat = unpack_int4_rows(packed).reshape(packed.shape[0], packed.shape[1], 8)
    idx = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nat.index_select(-1, idx).reshape(packed.shape[0], packed.shape[1] * 8)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """Codes int ``[R, C]`` (0..15) -> AutoAWQ "gemm" int32 ``[R, C // 8]``."""
    r, c = codes.shape
    if c % 8:
        raise ValueError(f"AWQ packing needs the packed dim ({c}) to be a multiple of 8")
    grouped = codes.reshape(r, c // 8, 8)
    idx = torch.tensor(AWQ_ORDER, device=codes.device)
    return pack_int4_rows(grouped.index_select(-1, idx).reshape(r, c))


def repack_awq_to_runtime(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert AutoAWQ disk tensors into the run-time layout (module docstring).

    Args:
        qweight: int32 ``[K, N // 8]``; qzeros: int32 ``[K // G, N // 8]``; scales: float ``[K // G, N]``.
        dtype: dtype of the returned scales/zeros (the activation dtype).
    Returns:
        ``(qweight_rt int32 [N, K // 8], scales [K // G, N], zeros [K // G, N])``.
    Raises:
        ValueError: on inconsistent shapes.
    """
    k, n8 = qweight.shape
    n = n8 * 8
    if scales.shape[1] != n or qzeros.shape != (scales.shape[0], n8) or k % scales.shape[0]:
        raise ValueError(
            f"inconsistent AWQ tensors: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    codes = unpack_awq(qweight)  # [K, N]
    qweight_rt = pack_int4_rows(codes.t().contiguous())  # [N, K // 8]
    zeros = unpack_awq(qzeros).to(dtype)  # [K // G, N]
    return qweight_rt.contiguous(), scales.to(dtype).contiguous(), zeros.contiguous()


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Run-time layout -> dense weight ``[N, K]`` (``nn.Linear`` orientation) in ``scales.dtype``."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 8
    group_size = k // scales.shape[0]
    codes = unpack_int4_rows(qweight).to(torch.float32)  # [N, K]
    s = scales.t().to(torch.float32).repeat_interleave(group_size, dim=1)  # [N, K]
    z = zeros.t().to(torch.float32).repeat_interleave(group_size, dim=1)
    assert codes.shape == (n, k)
    return ((codes - z) * s).to(scales.dtype)


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias)``, accumulated in fp32, returned in ``x.dtype``."""
    w = dequantize_w4(qweight, scales, zeros).to(torch.float32)  # [N, K]
    y = x.to(torch.float32) @ w.t()
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


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``.

    Slots of -1 are padding and skipped. For an int8 cache (``k_cache.dtype == torch.int8``)
    the four scale/zero tensors are required and written too.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    num_blocks, block_size = k_cache.shape[:2]
    kc = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    vc = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    slots = slot_mapping.long()
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and k_zero is not None and v_scale is not None and v_zero is not None
        qk, sk, zk = quantize_kv_int8(key)
        qv, sv, zv = quantize_kv_int8(value)
        kc[slots] = qk
        vc[slots] = qv
        k_scale.view(-1, k_scale.shape[-1])[slots] = sk
        k_zero.view(-1, k_zero.shape[-1])[slots] = zk
        v_scale.view(-1, v_scale.shape[-1])[slots] = sv
        v_zero.view(-1, v_zero.shape[-1])[slots] = zv
    else:
        kc[slots] = key.to(k_cache.dtype)
        vc[slots] = value.to(v_cache.dtype)


def _gather_rows(t: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``t [num_blocks_total, block_size, ...]`` -> ``[num_seqs, len(blocks) // num_seqs * block_size, ...]``."""
    # index_select on a 2-D [blocks, bytes per block] view copies whole rows at memcpy speed; on
    # the 4-D cache it is ~4x slower (measured on CPU).
    picked = t.reshape(t.shape[0], -1).index_select(0, blocks)
    return picked.view(num_seqs, -1, *t.shape[2:])


def gather_blocks(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    num_seqs: int,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Read whole cache blocks: int64 ``blocks [num_seqs * n]`` (each sequence's first ``n``
    block ids, in order) -> ``[num_seqs, n * block_size, num_kv_heads, head_dim]`` in ``dtype``,
    INT8 dequantized with ``scale``/``zero``."""
    x = _gather_rows(cache, blocks, num_seqs)
    if cache.dtype == torch.int8:
        assert scale is not None and zero is not None
        return dequantize_kv_int8(x, _gather_rows(scale, blocks, num_seqs), _gather_rows(zero, blocks, num_seqs),
                                  dtype)
    return x.to(dtype)


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Read the first ``length`` tokens of one sequence: -> ``[length, num_kv_heads, head_dim]`` in ``dtype``."""
    num_blocks = (length + cache.shape[1] - 1) // cache.shape[1]
    return gather_blocks(cache, block_table[:num_blocks].long(), 1, scale, zero, dtype)[0, :length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int) -> torch.Tensor:
    """q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]``; query i sees keys ``<= causal_offset + i``. fp32 softmax."""
    lq, lk = q.shape[0], k.shape[0]
    # [1, H, L, D]: torch's fused CPU kernel (flash, GQA-aware) takes only 4-D inputs; 3-D falls
    # back to the unfused math path, ~3x slower at 300 tokens.
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).to(torch.float32) for t in (q, k, v))
    mask = None
    if causal_offset != 0 or lq != lk:  # SDPA's is_causal aligns top-left; a cached prefix needs an offset
        qi = torch.arange(lq, device=q.device).unsqueeze(1) + causal_offset
        mask = torch.arange(lk, device=q.device).unsqueeze(0) <= qi
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).to(q.dtype)


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


# Every layer of a step calls the decode with the same block_tables / context_lens tensors;
# the grouping is computed once per step and reused. The key holds the tensor objects (so
# their identity cannot be recycled while cached) and their in-place version counters.
_decode_plan_cache: tuple[torch.Tensor, torch.Tensor, tuple, list[_DecodeGroup]] | None = None


def _decode_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
) -> list[_DecodeGroup]:
    global _decode_plan_cache
    # inference-mode tensors (the engine's) keep no version counter; they are made fresh each step
    versions = tuple(-1 if t.is_inference() else t._version for t in (block_tables, context_lens))
    values = (*versions, block_size, num_kv_heads, head_dim)
    cached = _decode_plan_cache
    if cached is not None and cached[0] is block_tables and cached[1] is context_lens and cached[2] == values:
        return cached[3]
    lens = context_lens.long()
    # The engine lays decodes out sorted by length, so groups are contiguous slices (views, no
    # index copies); other callers get an argsort.
    in_order = bool((lens[1:] >= lens[:-1]).all())
    order = None if in_order else torch.argsort(lens)
    sorted_lens = (lens if order is None else lens[order]).tolist()
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
        group_lens = lens[idx]
        num_blocks = (int(group_lens.max()) + block_size - 1) // block_size
        blocks = block_tables[idx, :num_blocks].long().clamp(min=0).flatten()
        mask = torch.arange(num_blocks * block_size, device=lens.device) < group_lens.unsqueeze(1)
        groups.append(_DecodeGroup(idx, blocks, num_blocks, mask[:, None, None, :]))
    _decode_plan_cache = (block_tables, context_lens, values, groups)
    return groups


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

    This is the engine's CPU decode path: sequences are sorted by context length and cut into
    groups (see :data:`DECODE_PAD_TOKENS`); each group gathers whole blocks, pads to its longest
    context, masks the padding and runs one ``scaled_dot_product_attention`` (fp32). GQA:
    the ``H // Hkv`` query heads of a KV head ride as that head's query rows, so K/V are
    never repeated.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        block_tables: int32 ``[num_seqs, max_num_blocks]`` (unused entries -1).
        context_lens: int32 ``[num_seqs]`` tokens in the cache, the new one included.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    for g in _decode_plan(block_tables, context_lens, k_cache.shape[1], num_kv_heads, head_dim):
        n = g.blocks.numel() // g.num_blocks
        k = gather_blocks(k_cache, g.blocks, n, k_scale, k_zero, torch.float32)
        v = gather_blocks(v_cache, g.blocks, n, v_scale, v_zero, torch.float32)
        qf = q[g.seqs].to(torch.float32).reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(qf, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale)
        out[g.seqs] = o.reshape(n, num_heads, head_dim).to(q.dtype)
    return out


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
        q: ``[num_tokens, num_heads, head_dim]``, sequences concatenated.
        cu_seqlens_q: int32 ``[num_seqs + 1]`` offsets of each sequence's new tokens in ``q``.
        context_lens: int32 ``[num_seqs]`` total tokens in the cache per sequence (prefix + new).
        block_tables: int32 ``[num_seqs, max_num_blocks]``.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for i, n in enumerate(context_lens.tolist()):
        a, b = bounds[i], bounds[i + 1]
        k = gather_kv(k_cache, block_tables[i], n, k_scale, k_zero, q.dtype)
        v = gather_kv(v_cache, block_tables[i], n, v_scale, v_zero, q.dtype)
        out[a:b] = _attend(q[a:b], k, v, scale, causal_offset=n - (b - a))
    return out


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention without a cache (calibration, profiling): q ``[T, H, D]``, k/v ``[T, Hkv, D]``."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for a, b in itertools.pairwise(bounds):
        if q.is_cuda:
            out[a:b] = _attend_gpu(q[a:b], k[a:b], v[a:b], scale)
        else:
            out[a:b] = _attend(q[a:b], k[a:b], v[a:b], scale, causal_offset=0)
    return out


def _attend_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence on a GPU, in its own dtype with K/V heads expanded.

    In fp32 with ``enable_gqa`` SDPA falls back to its math kernel and builds the whole
    ``[H, L, L]`` score matrix (1 GiB at 2,048 tokens and 32 heads), which the engine's profiling
    forward would then count as activation memory; fp16/bf16 without GQA take the flash kernel.
    """
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(group, 1),
                                                           v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1)


# ----------------------------------------------------------------------------- norm / rope / act


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim, computed in fp32, returned in ``x.dtype``."""
    # torch's fused kernel: the same fp32 arithmetic (bit-identical on CPU), one pass
    return F.rms_norm(x.to(torch.float32), (x.shape[-1],), weight.to(torch.float32), eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; returns ``(rms_norm(residual), residual)``. ``x`` may be a GEMM's
    unreduced :class:`SplitKPartials`."""
    if isinstance(x, SplitKPartials):
        x = x.reduced()
    residual = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    return rms_norm(residual, weight, eps), residual


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, HF Llama convention).

    Args:
        x: ``[num_tokens, num_heads, head_dim]``.
        cos, sin: ``[num_tokens, head_dim // 2]`` (already gathered at the tokens' positions).
    """
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c = cos.to(torch.float32).unsqueeze(1)
    s = sin.to(torch.float32).unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rotary_qk(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` with ``cos_cache``/``sin_cache``
    ``[max_position, D // 2]`` gathered at ``positions [T]``."""
    cos, sin = cos_cache[positions], sin_cache[positions]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def rope_store_kvcache(
    positions: torch.Tensor,
    qkv: torch.Tensor | SplitKPartials,
    num_heads: int,
    num_kv_heads: int,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """A fused qkv projection's output ``[T, (Hq + 2 Hk) D]`` (or its split-K partials): q and k rotated
    (:func:`rotary_qk`), k and v written at ``slot_mapping`` (:func:`store_kvcache`); returns q ``[T, Hq, D]``."""
    if isinstance(qkv, SplitKPartials):
        qkv = qkv.reduced()
    t, d = qkv.shape[0], 2 * cos_cache.shape[1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = rotary_qk(positions, q.reshape(t, num_heads, d), k.reshape(t, num_kv_heads, d), cos_cache, sin_cache)
    store_kvcache(k, v.reshape(t, num_kv_heads, d), k_cache, v_cache, slot_mapping, k_scale, k_zero, v_scale, v_zero)
    return q


def silu_and_mul(x: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """``x [..., 2 I]`` (or a GEMM's unreduced :class:`SplitKPartials`) -> ``silu(x[..., :I]) * x[..., I:]``."""
    if isinstance(x, SplitKPartials):
        x = x.reduced()
    half = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :half].float()) * x[..., half:].float()).to(x.dtype)


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
