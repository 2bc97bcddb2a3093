"""Plain-PyTorch twins of every Triton kernel in this package.

These run on any device (the engine's CPU path uses them) and are the oracle the
kernel tests compare against. They favour clarity over speed, but avoid Python
loops over tokens where a vectorised form is just as clear.

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

import torch

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


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Read the first ``length`` tokens of one sequence: -> ``[length, num_kv_heads, head_dim]`` in ``dtype``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    x = cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:length]
    if cache.dtype == torch.int8:
        assert scale is not None and zero is not None
        s = scale[blocks].reshape(num_blocks * block_size, -1)[:length]
        z = zero[blocks].reshape(num_blocks * block_size, -1)[:length]
        return dequantize_kv_int8(x, s, z, dtype)
    return x.to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int) -> torch.Tensor:
    """q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]``; query i sees keys ``<= causal_offset + i``. fp32 softmax."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    qf, kf, vf = (t.transpose(0, 1).to(torch.float32) for t in (q, k, v))  # [H, L, D]
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, Lq, Lk]
    lq, lk = q.shape[0], k.shape[0]
    qi = torch.arange(lq, device=q.device).unsqueeze(1) + causal_offset
    kj = torch.arange(lk, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(kj > qi, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(0, 1).to(q.dtype)


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

    Vectorised over sequences (one gather of ``[num_seqs, max_context]`` slots, padded and
    masked): this is the engine's CPU decode path, so it avoids a Python loop per sequence.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        block_tables: int32 ``[num_seqs, max_num_blocks]`` (unused entries -1).
        context_lens: int32 ``[num_seqs]`` tokens in the cache, the new one included.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    max_len = int(context_lens.max())
    pos = torch.arange(max_len, device=q.device)
    blocks = block_tables[:, pos // block_size].long().clamp(min=0)  # [S, L]
    slots = blocks * block_size + pos % block_size

    def read(cache: torch.Tensor, s: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
        x = cache.view(-1, num_kv_heads, head_dim)[slots]  # [S, L, Hkv, D]
        if cache.dtype == torch.int8:
            assert s is not None and z is not None
            return dequantize_kv_int8(x, s.view(-1, num_kv_heads)[slots], z.view(-1, num_kv_heads)[slots],
                                      torch.float32)
        return x.to(torch.float32)

    k = read(k_cache, k_scale, k_zero)
    v = read(v_cache, v_scale, v_zero)
    group = num_heads // num_kv_heads
    qf = q.to(torch.float32).view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", qf, k) * scale
    pad = pos.unsqueeze(0) >= context_lens.to(pos.device).unsqueeze(1)  # [S, L]
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    out = torch.einsum("skgl,slkd->skgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


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
    for i in range(cu_seqlens_q.numel() - 1):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        n = int(context_lens[i])
        k = gather_kv(k_cache, block_tables[i], n, k_scale, k_zero, q.dtype)
        v = gather_kv(v_cache, block_tables[i], n, v_scale, v_zero, q.dtype)
        out[a:b] = _attend(q[a:b], k, v, scale, causal_offset=n - (b - a))
    return out


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention without a cache (calibration, profiling): q ``[T, H, D]``, k/v ``[T, Hkv, D]``."""
    out = torch.empty_like(q)
    for i in range(cu_seqlens.numel() - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        out[a:b] = _attend(q[a:b], k[a:b], v[a:b], scale, causal_offset=0)
    return out


# ----------------------------------------------------------------------------- norm / rope / act


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim, computed in fp32, returned in ``x.dtype``."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(torch.float32)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; returns ``(rms_norm(residual), residual)``."""
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2 I]`` -> ``silu(x[..., :I]) * x[..., I:]``."""
    half = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :half].float()) * x[..., half:].float()).to(x.dtype)
