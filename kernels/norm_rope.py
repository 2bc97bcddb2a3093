"""Element-wise and row-wise kernels: RMSNorm, fused residual add + RMSNorm, rotary, SiLU-and-mul.

All compute in fp32 and return the input dtype, like their twins in ``reference``. One program
per row (token); the whole row lives in registers (hidden sizes up to 16384). Outputs are new
tensors: inputs are never modified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, TRITON_DTYPE, LaunchSpec, check_device, next_pow2

MAX_HIDDEN = 16384
SILU_BLOCK = 1024
HIDDEN_SIZES = (576, 4096, 8192, 14336)  # sizes the smem check compiles (any size up to MAX_HIDDEN runs)


def _warps(block: int) -> int:
    # ~8 to 16 elements per thread: enough loads in flight per thread without spilling.
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_r, stride_o, stride_ro,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the new residual, rounded like the reference
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, half, stride_xt, stride_xh, stride_ot, stride_oh,
                   stride_ct, stride_st, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_mask = offs_c < half
    mask = (offs_h[:, None] < num_heads) & c_mask[None, :]
    c = tl.load(cos_ptr + t * stride_ct + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_c[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    obase = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(obase, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(obase + half, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (a / (1.0 + tl.exp(-a)) * b).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x [..., H]`` -> a 2-D ``[rows, H]`` view (copy only if the rows cannot be viewed). Raises ValueError."""
    if x.dtype not in FLOAT_DTYPES or x.dim() < 1:
        raise ValueError(f"{name}: expected a float tensor [..., H], got {x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(name: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    if weight.shape != (h,) or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: weight must be float [{h}], got {tuple(weight.shape)} {weight.dtype}")
    if h > MAX_HIDDEN:
        raise ValueError(f"{name}: hidden size {h} > {MAX_HIDDEN}")
    if residual is not None and (residual.shape != x.shape or residual.dtype not in FLOAT_DTYPES):
        raise ValueError(f"{name}: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    check_device(name, x, residual, weight)
    x2 = _rows(name, x)
    r2 = _rows(name, residual) if residual is not None else None
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if x2.shape[0]:
        block = next_pow2(h)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2 if r2 is not None else x2, weight, out, r_out if r_out is not None else out, h,
            x2.stride(0), (r2 if r2 is not None else x2).stride(0), out.stride(0), out.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
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
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (rounded to ``x.dtype``); returns ``(rms_norm(residual), residual)``.

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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama convention); any scaling (llama3, yarn) lives in ``cos``/``sin``.

    Args:
        x: float ``[num_tokens, num_heads, head_dim]`` (head_dim even), stride 1 on head_dim.
        cos, sin: float ``[num_tokens, head_dim // 2]``, gathered at the tokens' positions.
    Returns:
        New ``[num_tokens, num_heads, head_dim]`` tensor in ``x.dtype``.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    if x.dim() != 3 or x.shape[2] % 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"apply_rotary: x must be float [num_tokens, num_heads, even head_dim], got "
                         f"{tuple(x.shape)} {x.dtype}")
    t, h, d = x.shape
    half = d // 2
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape != (t, half) or c.dtype not in FLOAT_DTYPES or c.stride(1) != 1:
            raise ValueError(f"apply_rotary: {name} must be float [{t}, {half}] with stride 1, got "
                             f"{tuple(c.shape)} {c.dtype}")
    check_device("apply_rotary", x, cos, sin)
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        block_h, block_half = next_pow2(h), next_pow2(half)
        _rotary_kernel[(t,)](x, cos, sin, out, h, half, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                             cos.stride(0), sin.stride(0), BLOCK_H=block_h, BLOCK_HALF=block_half,
                             num_warps=_warps(block_h * block_half))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2 I]`` -> ``silu(x[..., :I]) * x[..., I:]`` in fp32, returned in ``x.dtype``.

    Raises:
        ValueError: odd last dim, non-float dtype, or a device Triton cannot run on.
    """
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even, got {tuple(x.shape)}")
    check_device("silu_and_mul", x)
    x2 = _rows("silu_and_mul", x)
    inter = x.shape[-1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, SILU_BLOCK))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=SILU_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], inter)


def launch_specs() -> list[LaunchSpec]:
    """Kernel variants for the smem check (fp16): norms at common hidden sizes, rotary, SiLU."""
    specs = []
    for h in HIDDEN_SIZES:
        block = next_pow2(h)
        for res in (False, True):
            ce = {"HAS_RESIDUAL": res, "BLOCK": block}
            sig = {**dict.fromkeys(["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"], "*fp16"),
                   **dict.fromkeys(["n_cols", "stride_x", "stride_r", "stride_o", "stride_ro"], "i32"), "eps": "fp32",
                   **dict.fromkeys(ce, "constexpr")}
            specs.append(LaunchSpec("rms_norm", _rms_norm_kernel, sig, ce, _warps(block), 1))
    for heads, d in ((32, 128), (8, 128), (9, 64)):
        ce = {"BLOCK_H": next_pow2(heads), "BLOCK_HALF": d // 2}
        sig = {**dict.fromkeys(["x_ptr", "cos_ptr", "sin_ptr", "out_ptr"], "*fp16"),
               **dict.fromkeys(["num_heads", "half", "stride_xt", "stride_xh", "stride_ot", "stride_oh", "stride_ct",
                                "stride_st"], "i32"), **dict.fromkeys(ce, "constexpr")}
        specs.append(LaunchSpec("rotary", _rotary_kernel, sig, ce, _warps(ce["BLOCK_H"] * ce["BLOCK_HALF"]), 1))
    sig = {"x_ptr": "*" + TRITON_DTYPE[torch.float16], "out_ptr": "*fp16", "inter": "i32", "stride_x": "i32",
           "stride_o": "i32", "BLOCK": "constexpr"}
    specs.append(LaunchSpec("silu_and_mul", _silu_and_mul_kernel, sig, {"BLOCK": SILU_BLOCK}, 4, 1))
    return specs
