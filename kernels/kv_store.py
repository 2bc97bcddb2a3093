"""Write new K/V tokens into the paged cache (fp16/bf16/fp32 or INT8 quantized in the same kernel).

Cache layout (``reference`` module docstring): ``k_cache``/``v_cache`` ``[num_blocks, block_size,
num_kv_heads, head_dim]``; slot ``s`` = block ``s // block_size``, offset ``s % block_size``.
INT8 caches also take ``k_scale, k_zero, v_scale, v_zero`` float16 ``[num_blocks, block_size,
num_kv_heads]``, computed per token and head exactly as ``reference.quantize_kv_int8``:

    scale = fp16((max - min) / 255)  (1 where max == min)
    zero  = fp16(min + 128 * scale)
    q     = clamp(round_half_even((x - zero) / scale), -128, 127)

One program per token writes all its heads, K and V. Slots of -1 (padding) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, TRITON_DTYPE, LaunchSpec, check_cache_dtype, check_device, next_pow2
from .pdl import pdl_launch, pdl_start

NUM_WARPS = 4
HEAD_DIMS = (64, 128)  # head sizes the smem check compiles (the launcher takes any)
NUM_KV_HEADS = (1, 8, 32)


@triton.jit
def _round_half_even(y):
    # Adding and subtracting 1.5 * 2^23 rounds an fp32 |y| < 2^22 to the nearest integer, ties to
    # even (the FPU's mode), like torch.round; the interpreter lacks libdevice.rint.
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _quantize_rows(x, mask):
    """x fp32 [BLOCK_H, BLOCK_D] (masked lanes ignored) -> (q fp32 codes, scale fp32, zero fp32)."""
    lo = tl.min(tl.where(mask, x, float("inf")), axis=1)
    hi = tl.max(tl.where(mask, x, float("-inf")), axis=1)
    scale = tl.math.div_rn(hi - lo, 255.0)
    scale = tl.where(scale > 0, scale, 1.0)
    scale = scale.to(tl.float16).to(tl.float32)  # quantize against the value that is stored
    zero = (lo + 128.0 * scale).to(tl.float16).to(tl.float32)
    q = _round_half_even(tl.math.div_rn(x - zero[:, None], scale[:, None]))
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    return q, scale, zero


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    stride_sb, stride_so, stride_sh,
    QUANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return  # padding token
    blk = slot // block_size
    off = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    # k_cache and v_cache share strides (checked by the launcher).
    dst = blk * stride_cb + off * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
    if QUANT:
        qk, sk, zk = _quantize_rows(k.to(tl.float32), mask)
        qv, sv, zv = _quantize_rows(v.to(tl.float32), mask)
        tl.store(kc_ptr + dst, qk.to(tl.int8), mask=mask)
        tl.store(vc_ptr + dst, qv.to(tl.int8), mask=mask)
        sdst = blk * stride_sb + off * stride_so + offs_h * stride_sh  # [blocks, block_size, heads], any strides
        hmask = offs_h < num_kv_heads
        tl.store(ks_ptr + sdst, sk.to(tl.float16), mask=hmask)
        tl.store(kz_ptr + sdst, zk.to(tl.float16), mask=hmask)
        tl.store(vs_ptr + sdst, sv.to(tl.float16), mask=hmask)
        tl.store(vz_ptr + sdst, zv.to(tl.float16), mask=hmask)
    else:
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def check_store_target(name: str, num_tokens: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, aux: tuple) -> bool:
    """Check the caches, slot mapping and INT8 scales/zeros ``aux`` a store writes (module docstring
    layouts); returns whether the cache is INT8.

    Raises:
        ValueError: naming ``name``, on a bad shape, dtype or stride.
    """
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"{name}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                         f"[num_blocks, block_size, {num_kv_heads}, {head_dim}]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: k_cache and v_cache need one dtype, equal strides and stride 1 on head_dim")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: slot_mapping must be int32/int64 [{num_tokens}], got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    quant = check_cache_dtype(name, k_cache, aux)
    return quant


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

    Args:
        key, value: float ``[num_tokens, num_kv_heads, head_dim]``, stride 1 along head_dim.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float or int8,
            same shape and strides, stride 1 along head_dim; written in place.
        slot_mapping: int32/int64 ``[num_tokens]``; -1 = padding, skipped.
        k_scale, k_zero, v_scale, v_zero: float16 ``[num_blocks, block_size, num_kv_heads]``,
            any strides (the same for all four); required for an int8 cache (written in place),
            ignored otherwise.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"store_kvcache: key/value must be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} / {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.dtype not in FLOAT_DTYPES or value.dtype != key.dtype or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError(f"store_kvcache: key/value must be one float dtype with stride 1 on head_dim, got "
                         f"{key.dtype}/{value.dtype}")
    aux = (k_scale, k_zero, v_scale, v_zero)
    quant = check_store_target("store_kvcache", num_tokens, num_kv_heads, head_dim, k_cache, v_cache, slot_mapping, aux)
    check_device("store_kvcache", key, value, k_cache, v_cache, slot_mapping, *(aux if quant else ()))
    if num_tokens == 0:
        return
    ks, kz, vs, vz = aux if quant else (k_cache,) * 4  # unused pointers when not quantizing
    sb, so, sh = k_scale.stride() if quant else (0, 0, 0)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, ks, kz, vs, vz,
        num_kv_heads, head_dim, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), sb, so, sh,
        QUANT=quant, BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim), num_warps=NUM_WARPS,
        **pdl_launch(key.device),
    )


def launch_specs() -> list[LaunchSpec]:
    """Kernel variants for the smem check: fp16 and int8 caches at common head counts/sizes."""
    specs = []
    ints = ["num_kv_heads", "head_dim", "block_size", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
            "stride_cb", "stride_co", "stride_ch", "stride_sb", "stride_so", "stride_sh"]
    for cache_dt in (torch.float16, torch.int8):
        c = "*" + TRITON_DTYPE[cache_dt]
        for h in NUM_KV_HEADS:
            for d in HEAD_DIMS:
                ce = {"QUANT": cache_dt == torch.int8, "BLOCK_H": h, "BLOCK_D": d}
                sig = {"k_ptr": "*fp16", "v_ptr": "*fp16", "kc_ptr": c, "vc_ptr": c, "slot_ptr": "*i64",
                       "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16", "vz_ptr": "*fp16",
                       **dict.fromkeys(ints, "i32"), **dict.fromkeys(ce, "constexpr")}
                specs.append(LaunchSpec(f"store_kv[{cache_dt}]", _store_kv_kernel, sig, ce, NUM_WARPS, 1))
    return specs
