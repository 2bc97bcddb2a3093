"""Write new K/V tokens into the paged cache (fp16/bf16/fp32 or INT8 quantized in the same kernel).

Cache layout (``paged_kv`` module docstring, one :class:`PagedKV` per layer): ``k``/``v`` ``[num_blocks,
block_size, num_kv_heads, head_dim]``; slot ``s`` = block ``s // block_size``, offset ``s % block_size``.
INT8 caches also take ``k_scale, k_zero, v_scale, v_zero`` float16 ``[num_blocks, block_size,
num_kv_heads]``, computed per token and head exactly as ``reference.quantize_kv_int8``
(``kv_quant_jit.quantize_rows``).

One program per token writes all its heads, K and V. Slots of -1 (padding) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant_jit import quantize_rows
from .launch_utils import COMPILE_OPTIONS, FLOAT_DTYPES, check_device, next_pow2
from .paged_kv import PagedKV
from .pdl import pdl_launch, pdl_start

NUM_WARPS = 4


@triton.jit
def store_kv_kernel(
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
        qk, sk, zk = quantize_rows(k.to(tl.float32), mask)
        qv, sv, zv = quantize_rows(v.to(tl.float32), mask)
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


def check_store_target(name: str, num_tokens: int, num_kv_heads: int, head_dim: int, kv: PagedKV,
                       slot_mapping: torch.Tensor) -> None:
    """Check that ``kv`` holds ``num_kv_heads`` heads of ``head_dim`` and that ``slot_mapping`` is an int32/int64
    ``[num_tokens]`` tensor (the cache's own layout :class:`PagedKV` checked when it was made).

    Raises:
        ValueError: naming ``name``, on a bad shape or dtype.
    """
    if (kv.num_kv_heads, kv.head_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"{name}: the cache {tuple(kv.k.shape)} must be [num_blocks, block_size, {num_kv_heads}, "
                         f"{head_dim}]")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: slot_mapping must be int32/int64 [{num_tokens}], got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")


def store_kvcache(key: torch.Tensor, value: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``.

    Args:
        key, value: float ``[num_tokens, num_kv_heads, head_dim]``, stride 1 along head_dim.
        kv: the layer's cache (:class:`PagedKV`), written in place; an INT8 cache gets the codes and each
            token's and head's scale and zero.
        slot_mapping: int32/int64 ``[num_tokens]``; -1 = padding, skipped.
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
    check_store_target("store_kvcache", num_tokens, num_kv_heads, head_dim, kv, slot_mapping)
    check_device("store_kvcache", key, value, slot_mapping, *kv.tensors())
    if num_tokens == 0:
        return
    quant = kv.is_int8
    ks, kz, vs, vz = kv.scales if quant else (kv.k,) * 4  # unused pointers when not quantizing
    sb, so, sh = kv.k_scale.stride() if quant else (0, 0, 0)
    store_kv_kernel[(num_tokens,)](
        key, value, kv.k, kv.v, slot_mapping, ks, kz, vs, vz,
        num_kv_heads, head_dim, kv.block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), sb, so, sh,
        QUANT=quant, BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim), num_warps=NUM_WARPS,
        **pdl_launch(key.device), **COMPILE_OPTIONS,
    )
