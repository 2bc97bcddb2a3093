"""W8A16 GEMM: ``y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias)`` with 8-bit integer weights.

Weights are in the W8 run-time layout of :mod:`lightinfer.kernels.reference` (its twin there is
:func:`~lightinfer.kernels.reference.w8a16_gemm`)::

    qweight int8 [N, K]     scales fp32 [K // G, N]     zeros fp32 [K // G, N] or None
    w[k, n] = (q[n, k] - zeros[k // G, n]) * scales[k // G, n]

It runs the tensors GGUF stores with more than 4 bits (Q8_0, Q6_K, Q5_*: the LM head and a Q4_K_M
file's Q6_K layers) and 8-bit GPTQ, at about half the bytes of fp16. One tiled kernel: each program
owns a ``[BLOCK_M, BLOCK_N]`` tile of y, walks K in ``BLOCK_K`` steps, decodes the int8 codes to fp32
(exact), subtracts the zero, applies the scale of each code's group (any G: the group of a row of the
tile is ``k // G``), and feeds ``tl.dot`` in the activation dtype with fp32 accumulation (fp32 inputs
stay fp32: ``input_precision="ieee"``). Zeros may be fractional (GGUF Q5_1 / Q5_K): the subtraction
is in fp32, nothing is rounded to an integer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_utils import COMPILE_OPTIONS, FLOAT_DTYPES, check_device, upcast_dot
from .pdl import pdl_launch, pdl_start

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode batches and prefill chunks. Small tiles keep the
# shared memory far below a consumer card's 99 KB (audit/specs.py feeds the smem check).
CONFIGS = ((16, 64, 64, 4), (64, 64, 64, 4))


@triton.jit
def w8a16_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, K, G, stride_xm, stride_ym,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        kn_ok = k_ok[:, None] & n_ok[None, :]
        # [BLOCK_K, BLOCK_N] tile of W^T: code (k, n) sits at q[n, k]
        q = tl.load(q_ptr + offs_n[None, :] * K + offs_k[:, None], mask=kn_ok, other=0)
        g_off = (offs_k // G)[:, None] * N + offs_n[None, :]
        w = q.to(tl.float32)
        if HAS_ZERO:
            w = w - tl.load(z_ptr + g_off, mask=kn_ok, other=0.0)
        w = w * tl.load(s_ptr + g_off, mask=kn_ok, other=0.0)
        if x.dtype == tl.float32:
            acc += tl.dot(x, w, input_precision="ieee")
        elif UPCAST_DOT:  # the CPU interpreter's bf16 dot is broken (launch_utils.upcast_dot)
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _config(m: int) -> tuple[int, int, int, int]:
    return CONFIGS[0] if m <= CONFIGS[0][0] else CONFIGS[1]


def w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias)``, fp32 accumulation, returned in ``x.dtype``.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, stride 1 along K.
        qweight: int8 ``[N, K]`` contiguous (W8 run-time layout, module docstring).
        scales: fp32 ``[K // G, N]`` contiguous; zeros: the same or None (symmetric).
        bias: optional ``[N]``.
    Raises:
        ValueError: wrong dtypes, shapes or strides; tensors on a device Triton cannot run on.
    """
    dev = check_device("w8a16_gemm", x, qweight, scales, zeros, bias)
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"w8a16_gemm: x must be a 2-D float tensor with stride 1 along K, got {tuple(x.shape)} "
                         f"{x.dtype} strides {x.stride()}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.int8 or tuple(qweight.shape) != (n, k) or not qweight.is_contiguous():
        raise ValueError(f"w8a16_gemm: qweight must be contiguous int8 [N, K={k}], got {tuple(qweight.shape)} "
                         f"{qweight.dtype}")
    num_groups = scales.shape[0] if scales.dim() == 2 else 0
    if (scales.dtype != torch.float32 or scales.dim() != 2 or scales.shape[1] != n or num_groups == 0
            or k % num_groups or not scales.is_contiguous()):
        raise ValueError(f"w8a16_gemm: scales must be contiguous fp32 [K // G, N={n}] with G dividing K={k}, "
                         f"got {tuple(scales.shape)} {scales.dtype}")
    if zeros is not None and (zeros.dtype != torch.float32 or zeros.shape != scales.shape or not zeros.is_contiguous()):
        raise ValueError(f"w8a16_gemm: zeros must be contiguous fp32 {tuple(scales.shape)} or None, "
                         f"got {tuple(zeros.shape)} {zeros.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"w8a16_gemm: bias must be [N={n}], got {tuple(bias.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=dev)
    if m == 0:
        return y
    block_m, block_n, block_k, num_warps = _config(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    w8a16_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        m, n, k, k // num_groups, x.stride(0), y.stride(0),
        HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, UPCAST_DOT=upcast_dot(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **pdl_launch(dev), **COMPILE_OPTIONS,
    )
    return y

