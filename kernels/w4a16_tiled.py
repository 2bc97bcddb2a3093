"""W4A16 tensor-core GEMM, in two operand orders: the ``tiled`` and ``swap_ab`` paths of :mod:`.w4a16_gemm`.

``tiled`` multiplies ``x [BLOCK_M, BLOCK_K] @ W^T [BLOCK_K, BLOCK_N]``: the dequantized weight tile is the
*B* operand. Hopper's wgmma reads B only from shared memory, so every K step stores the freshly
dequantized tile there, fences and waits before the tensor cores may start; before Hopper, mma.sync needs
it re-laid out for the B fragment as well.

``swap_ab`` (``SWAP_AB=True``) computes ``y^T[N, M] = dequant(W)[N, K] @ x^T[K, M]``: the weight tile is
the *A* operand, which wgmma takes straight from registers (Hopper's mixed-input GEMMs, e.g. CUTLASS's,
use this order for the same reason), while x, a plain load, is B and streams into shared memory
asynchronously. The weight rows become the MMA's M dimension (64 per warp group, which N always fills)
and the tokens its N dimension, which can be as small as 16: a decode batch of 3..16 no longer pads the
tile the weights flow through. ``python -m lightinfer.kernels.audit.sass_stats`` counts both.

Both: ``BLOCK_K`` divides the group size, so one K step lies in one group (one scale and zero per weight
row); x and the weight words are software-pipelined (``num_stages``: they feed ``tl.dot``), scales and
zeros loaded a step ahead (:func:`.w4_decode.k_step_scales`); split-K writes fp32 partials. With fp16
activations and integer zero points (``F16_DECODE``) the weights are decoded as fp16 pairs, two per
instruction (:func:`.w4_decode.unpack_minus_zero_f16`; ``USE_PTX`` on a GPU, plain Triton on the
interpreter); fractional zero points (``INTEGER_ZEROS=False``) take the exact fp32 decode.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .w4_decode import decode_minus_zero, k_split_begin, k_step_scales, scale_rows, store_output


@triton.jit
def w4a16_tiled_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, stride_xm, stride_qn, stride_sg, stride_ym, stride_ys, num_k_steps, steps_per_split, nibble_mask,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr, SWAP_AB: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, F16_DECODE: tl.constexpr = False,
    USE_PTX: tl.constexpr = False, INTEGER_ZEROS: tl.constexpr = False,
):
    # Grid (M tiles, N tiles, splits); swapped, (N tiles, M tiles, splits): weight tiles vary fastest, so
    # programs running together share x.
    if SWAP_AB:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    m_mask = offs_m < M
    n_mask = offs_n < N
    t_start, t_end, s_next, z_next = k_split_begin(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, N, stride_qn, stride_sg, pid_k,
                                                   num_k_steps, steps_per_split, GROUP_SIZE, BLOCK_K, USE_PDL,
                                                   PREFETCH)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        s, z, s_next, z_next = k_step_scales(s_ptr, z_ptr, s_next, z_next, t, t_end, offs_n, n_mask, stride_sg,
                                             GROUP_SIZE, BLOCK_K)
        if SWAP_AB:
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None],
                         mask=m_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]: x^T
        else:
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                         mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]: x
        if UPCAST_DOT:
            xt = xt.to(tl.float32)  # CPU interpreter only: its bf16 tl.dot returns garbage (Triton 3.9)
        words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :],
                        mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_K // 8]
        # [BLOCK_N, BLOCK_K]: q - z, exact; with fp16 activations already fp16, two weights per instruction
        qz = decode_minus_zero(words, z, nibble_mask, BLOCK_K, F16_DECODE, USE_PTX, INTEGER_ZEROS)
        # One K step is one group, so for small token tiles the scale waits until after the dot: one
        # multiply per output instead of one per weight, and q - z enters the tensor cores exactly (sm_90,
        # 16 rows: 6.95 -> 6.11 instructions per weight). Larger tiles lose: the extra accumulator costs
        # registers, and swapped, scaling first lets wgmma run asynchronously but costs 4.86 -> 6.86.
        if SWAP_AB:
            if BLOCK_M <= 64:
                acc += tl.dot(qz.to(xt.dtype), xt) * s[:, None]
            else:
                acc = tl.dot(scale_rows(qz, s, xt.dtype, F16_DECODE), xt, acc)
        else:
            if BLOCK_M <= 32:
                acc += tl.dot(xt, tl.trans(qz.to(xt.dtype))) * s[None, :]
            else:
                acc = tl.dot(xt, tl.trans(scale_rows(qz, s, xt.dtype, F16_DECODE)), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    store_output(acc, bias_ptr, y_ptr, offs_m, offs_n, m_mask[:, None] & n_mask[None, :], n_mask, pid_k,
                 stride_ym, stride_ys, HAS_BIAS, SPLIT)
