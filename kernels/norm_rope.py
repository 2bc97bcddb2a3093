"""Element-wise and row-wise kernels: RMSNorm, fused residual add + RMSNorm, rotary, SiLU-and-mul and
GeGLU (tanh-GELU-and-mul, Gemma's MLP).

All compute in fp32 and return the input dtype, like their twins in ``reference``. One program
per row (token); the whole row lives in registers (hidden sizes up to 16384). Outputs are new
tensors: inputs are never modified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_utils import COMPILE_OPTIONS, FLOAT_DTYPES, as_rows, check_device, next_pow2
from .pdl import pdl_launch, pdl_start
from .split_k import SplitKPartials, split_k_args
from .split_k_jit import load_input

MAX_HIDDEN = 16384
SILU_BLOCK = 1024


def num_warps_for(block: int) -> int:
    """Warps for a row kernel over ``block`` elements: ~8 to 16 elements per thread, enough loads in flight
    per thread without spilling."""
    return max(1, min(16, block // 256))


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_r, stride_o, stride_ro,
                    eps, xb_ptr, stride_split, num_splits, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                    SPLITS: tl.constexpr = False, SPLIT_BIAS: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = load_input(x_ptr + row * stride_x, xb_ptr, cols, mask, stride_split, num_splits, SPLITS, SPLIT_BIAS,
                   out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the new residual, rounded like the reference
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(x_row, o_row, num_heads, stride_h, stride_oh, half, c, s, offs_c, c_mask, BLOCK_H: tl.constexpr):
    """Rotate-half one token's ``[num_heads, 2 * half]`` heads at ``x_row`` into ``o_row``; ``c``, ``s``
    ``[1, BLOCK_HALF]`` fp32."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < num_heads) & c_mask[None, :]
    base = x_row + offs_h[:, None] * stride_h + offs_c[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    obase = o_row + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(obase, (x1 * c - x2 * s).to(o_row.dtype.element_ty), mask=mask)
    tl.store(obase + half, (x2 * c + x1 * s).to(o_row.dtype.element_ty), mask=mask)


@triton.jit
def rotary_qk_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, num_q_heads, num_k_heads, half,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                     stride_cp, stride_sp, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    # One program per token: cos/sin read from the tables at the token's position, q and k rotated.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_mask = offs_c < half
    c = tl.load(cos_ptr + pos * stride_cp + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sp + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, num_q_heads, stride_qh, stride_qoh, half, c, s,
                  offs_c, c_mask, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, num_k_heads, stride_kh, stride_koh, half, c, s,
                  offs_c, c_mask, BLOCK_HK)


@triton.jit
def tanh_f32(x):
    """tanh in fp32 from one exp (no libdevice call, so the CPU interpreter runs it too): ``1 - 2 / (e^2x + 1)``,
    exact at the limits (e^2x overflowing to inf gives 1, underflowing to 0 gives -1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


ACT_SILU = 0  # silu_and_mul_kernel's ACT: which gate activation
ACT_GELU_TANH = 1


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, xb_ptr, stride_split, num_splits,
                        BLOCK: tl.constexpr, SPLITS: tl.constexpr = False, SPLIT_BIAS: tl.constexpr = False,
                        USE_PDL: tl.constexpr = False, ACT: tl.constexpr = 0):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = out_ptr.dtype.element_ty
    a = load_input(x_ptr + row * stride_x, xb_ptr, cols, mask, stride_split, num_splits, SPLITS, SPLIT_BIAS, dt)
    b = load_input(x_ptr + row * stride_x, xb_ptr, inter + cols, mask, stride_split, num_splits, SPLITS, SPLIT_BIAS,
                   dt)
    a, b = a.to(tl.float32), b.to(tl.float32)
    if ACT == 1:  # ACT_GELU_TANH: GELU, tanh approximation: 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))
        g = 0.5 * a * (1.0 + tanh_f32(0.7978845608028654 * (a + 0.044715 * a * a * a)))
    else:
        g = a / (1.0 + tl.exp(-a))
    tl.store(out_ptr + row * stride_o + cols, (g * b).to(out_ptr.dtype.element_ty), mask=mask)


def _norm(name: str, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    if weight.shape != (h,) or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: weight must be float [{h}], got {tuple(weight.shape)} {weight.dtype}")
    if h > MAX_HIDDEN:
        raise ValueError(f"{name}: hidden size {h} > {MAX_HIDDEN}")
    if residual is not None and (residual.shape != x.shape or residual.dtype not in FLOAT_DTYPES):
        raise ValueError(f"{name}: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    check_device(name, x, residual, weight)
    x2, split_args, split_ce = split_k_args(name, x)
    r2 = as_rows(name, residual) if residual is not None else None
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if x2.shape[0]:
        block = next_pow2(h)
        rms_norm_kernel[(x2.shape[0],)](
            x2, r2 if r2 is not None else x2, weight, out, r_out if r_out is not None else out, h,
            x2.stride(0), (r2 if r2 is not None else x2).stride(0), out.stride(0), out.stride(0), eps, *split_args,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block), **split_ce,
            **pdl_launch(x2.device), **COMPILE_OPTIONS)
    return out.view(x.shape), (r_out.view(x.shape) if r_out is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, returned in ``x.dtype``.

    Args:
        x: float ``[..., H]`` (H <= 16384); weight: float ``[H]``; eps: added to the mean square.
    Raises:
        ValueError: on bad shapes, dtypes or devices.
    """
    return _norm("rms_norm", x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (rounded to ``x.dtype``); returns ``(rms_norm(residual), residual)``.

    ``x`` may be a W4A16 GEMM's :class:`SplitKPartials`, summed as they are loaded (rounded to
    ``x.dtype`` first, as the reduction would have), which saves the reduction's launch.

    Args:
        x, residual: float ``[..., H]``; weight: float ``[H]``.
    Returns:
        Two new ``[..., H]`` tensors in ``x.dtype``; the inputs are not modified.
    Raises:
        ValueError: on bad shapes, dtypes or devices.
    """
    out, r = _norm("fused_add_rms_norm", x, residual, weight, eps)
    assert r is not None
    return out, r


def rotary_qk(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE (HF Llama convention) of q and k at ``positions`` in one launch, reading
    ``cos_cache``/``sin_cache`` (any scaling, llama3 or yarn, is in the tables) in the kernel: gathering
    the tables and rotating q and k apart took four launches per layer. Tables narrower than ``D // 2``
    rotate only the first ``R = 2 * cos_cache.shape[1]`` dims of each head (partial rotary, Phi-4-mini); the
    others are copied.

    Args:
        positions: int32/int64 ``[T]``, each below ``cos_cache.shape[0]`` (not checked: that would sync).
        q: float ``[T, Hq, D]``; k: float ``[T, Hk, D]`` (D even), stride 1 on D, same dtype.
        cos_cache, sin_cache: float ``[max_position, R // 2]`` (R <= D), stride 1 on the last dim.
    Returns:
        New ``(q_rot, k_rot)`` in q's dtype and shapes.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2 \
            or q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"rotary_qk: q [T, Hq, D] and k [T, Hk, D] (D even, one float dtype), got "
                         f"{tuple(q.shape)} {q.dtype} / {tuple(k.shape)} {k.dtype}")
    t, hq, d = q.shape
    half = cos_cache.shape[1] if cos_cache.dim() == 2 else -1
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary_qk: positions must be int32/int64 [{t}], got {tuple(positions.shape)} "
                         f"{positions.dtype}")
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if c.dim() != 2 or c.shape[1] != half or not 0 < half <= d // 2 or c.dtype not in FLOAT_DTYPES \
                or c.stride(1) != 1:
            raise ValueError(f"rotary_qk: {name} must be float [max_position, R // 2] (R <= {d} rotated dims) with "
                             f"stride 1, cos_cache and sin_cache of one shape, got {tuple(c.shape)} {c.dtype}")
    check_device("rotary_qk", q, k, positions, cos_cache, sin_cache)
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    if 2 * half < d:  # partial rotary: the kernel writes the rotated dims, the copies hold the rest
        q_out, k_out = q.contiguous().clone(), k.contiguous().clone()
    else:
        q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t:
        bq, bk, bh = next_pow2(hq), next_pow2(k.shape[1]), next_pow2(half)
        rotary_qk_kernel[(t,)](q, k, positions, cos_cache, sin_cache, q_out, k_out, hq, k.shape[1], half,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
                               k_out.stride(0), k_out.stride(1), cos_cache.stride(0), sin_cache.stride(0),
                               BLOCK_HQ=bq, BLOCK_HK=bk, BLOCK_HALF=bh, num_warps=num_warps_for(bq * bh),
                               **pdl_launch(q.device), **COMPILE_OPTIONS)
    return q_out, k_out


def _act_and_mul(name: str, x: torch.Tensor | SplitKPartials, act: int) -> torch.Tensor:
    if len(x.shape) < 1 or x.shape[-1] % 2:
        raise ValueError(f"{name}: last dim must be even, got {tuple(x.shape)}")
    check_device(name, x)
    x2, split_args, split_ce = split_k_args(name, x)
    inter = x.shape[-1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, SILU_BLOCK))](
            x2, out, inter, x2.stride(0), out.stride(0), *split_args, BLOCK=SILU_BLOCK, num_warps=4, **split_ce,
            ACT=act, **pdl_launch(x2.device), **COMPILE_OPTIONS)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """``x [..., 2 I]`` -> ``silu(x[..., :I]) * x[..., I:]`` in fp32, returned in ``x.dtype``.

    ``x`` may be a W4A16 GEMM's :class:`SplitKPartials` (``[M, 2 I]``), summed as they are loaded.

    Raises:
        ValueError: odd last dim, non-float dtype, or a device Triton cannot run on.
    """
    return _act_and_mul("silu_and_mul", x, ACT_SILU)


def gelu_tanh_and_mul(x: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """``x [..., 2 I]`` -> ``gelu_tanh(x[..., :I]) * x[..., I:]`` (GeGLU with tanh-approximated GELU, Gemma's MLP)
    in fp32, returned in ``x.dtype``; ``x`` may be split-K partials, as :func:`silu_and_mul`.

    Raises:
        ValueError: odd last dim, non-float dtype, or a device Triton cannot run on.
    """
    return _act_and_mul("gelu_tanh_and_mul", x, ACT_GELU_TANH)
