"""W4A16 tensor-core GEMM with the operands swapped: ``y^T[N, M] = dequant(W)[N, K] @ x^T[K, M]``.

The ``tiled`` path of :mod:`.w4a16_gemm` multiplies ``x [BLOCK_M, BLOCK_K] @ W^T [BLOCK_K, BLOCK_N]``:
the dequantized weight tile is the *B* operand, which Hopper's wgmma reads only from shared memory, so
every K step stores the freshly dequantized tile to shared memory, fences and waits before the tensor
cores may start; before Hopper, mma.sync needs it re-laid out for the B fragment as well. Swapping the
operands makes the weight tile the *A* operand, which wgmma takes straight from registers (the layout
Hopper's mixed-input GEMMs, e.g. CUTLASS's, use for the same reason), while x, a plain load, is B and
streams into shared memory asynchronously. The weight rows become the MMA's M dimension (64 per warp
group, which N always fills) and the tokens its N dimension, which can be as small as 16: a decode
batch of 3..16 no longer pads the tile that the weights flow through.

Same run-time weight layout, K steps, scale/zero prefetch and split-K workspace as the ``tiled`` path
(see :mod:`.w4a16_gemm`); the launcher there starts it as the ``"swap_ab"`` path with ``block_n`` weight
rows and ``block_m`` tokens per program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_start
from .w4_decode import prefetch_weight_rows, unpack_minus_zero


@triton.jit
def w4a16_swap_ab_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, stride_xm, stride_qn, stride_sg, stride_ym, stride_ys, num_k_steps, steps_per_split, nibble_mask,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # Grid (N tiles, M tiles, splits): weight tiles vary fastest, so programs running together share x.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if USE_PDL:  # this program's K slice of weights into L2 while the previous kernel finishes
        t0 = pid_k * steps_per_split
        prefetch_weight_rows(qw_ptr, offs_n, N, stride_qn, t0 * (BLOCK_K // 8),
                             tl.minimum(t0 + steps_per_split, num_k_steps) * (BLOCK_K // 8))
    pdl_start(USE_PDL)  # before any other memory access (kernels/pdl.py)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile
    t_start = pid_k * steps_per_split
    t_end = tl.minimum(t_start + steps_per_split, num_k_steps)
    STEPS_PER_GROUP: tl.constexpr = GROUP_SIZE // BLOCK_K
    s_next = tl.load(s_ptr + (t_start // STEPS_PER_GROUP) * stride_sg + offs_n, mask=n_mask, other=0.0)
    z_next = tl.load(z_ptr + (t_start // STEPS_PER_GROUP) * stride_sg + offs_n, mask=n_mask, other=0.0)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        s = s_next.to(tl.float32)
        z = z_next.to(tl.float32)
        g_ahead = tl.minimum(t + 1, t_end - 1) // STEPS_PER_GROUP  # one step ahead, as the tiled path
        s_next = tl.load(s_ptr + g_ahead * stride_sg + offs_n, mask=n_mask, other=0.0)
        z_next = tl.load(z_ptr + g_ahead * stride_sg + offs_n, mask=n_mask, other=0.0)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None],
                     mask=m_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]: x^T
        words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :],
                        mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_K // 8]
        qz = unpack_minus_zero(words, z, nibble_mask, BLOCK_K)  # [BLOCK_N, BLOCK_K]: q - z, exact
        if UPCAST_DOT:  # CPU interpreter only (bf16 tl.dot is broken there)
            xt = xt.to(tl.float32)
        if BLOCK_M <= 64:
            # The scale waits until after the dot (one K step is inside one group): BLOCK_N x BLOCK_M
            # multiplies per step instead of BLOCK_N x BLOCK_K, and q - z enters the tensor cores exactly.
            acc += tl.dot(qz.to(xt.dtype), xt) * s[:, None]
        else:
            acc = tl.dot((qz * s[:, None]).to(xt.dtype), xt, acc)
    y_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:  # this split's fp32 slice of the [split, M, N] workspace
        tl.store(y_ptr + pid_k * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None], acc, mask=y_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=y_mask)
