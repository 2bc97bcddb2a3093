"""W4A16 GEMM: ``y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias)`` with 4-bit AWQ weights.

Weights are in the run-time layout of :mod:`lightinfer.kernels.w4_layout`::

    qweight int32 [N, K // 8]   nibble i of word j of row n = code of (k = 8 j + i, n)
    scales  [K // G, N], zeros [K // G, N] (zero point as a float: integer for AWQ / GPTQ / compressed-tensors /
                                            GGUF Q4_0, fractional for GGUF Q4_1 / Q4_K)
    w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]

Every path subtracts the zero point exactly, fractional or not (:data:`FRACTIONAL_ZEROS`). A caller that knows
its zeros are integers says so (``integer_zeros=True``, what ``W4A16Linear`` works out at load): the kernels
then decode ``q - z`` with one FADD per weight, or with fp16 activations as fp16 pairs, one HADD2 per two
weights. Otherwise they subtract in fp32 in two steps, one FADD more per weight and no fp16 pairs
(:mod:`.w4_decode` says why). The flag is a constexpr: the integer-zero kernels are compiled as before.

Four paths. On a GPU model with a tuned file (``kernels/configs/w4a16_<device>.json``, written by
``bench/kernels/tune_w4a16.py``, read by :mod:`.w4a16_tuning`) the path, tile, pipeline depth and split-K of each
weight shape and M are the ones measured fastest there; otherwise they are the built-in choices below,
picked by M (``GEMV_MAX_M`` / ``TILED_MAX_M``; ``swap_ab`` only from a tuned file or when forced):

* ``gemv``   (decode, M tiny): memory-bound. Each program owns ``BLOCK_N`` output rows and a
  slice of the K groups (split-K). It works on the packed words one nibble position at a time:
  per weight one LOP3 and one FADD (two for fractional zeros) decode ``q - z`` exactly
  (:func:`unpack_minus_zero` says how) and one FFMA per row of x accumulates it; the scale is applied
  once per group and row.
* ``tiled``  (M up to a few hundred): tensor cores. ``[BLOCK_N, BLOCK_K]`` weight tiles are
  dequantized in registers and fed to ``tl.dot`` with fp32 accumulation; split-K when the
  M x N grid alone would leave SMs idle. With fp16 activations and integer zeros the weights are decoded
  as fp16 pairs, two per instruction (:func:`.w4_decode.unpack_minus_zero_f16`; also ``swap_ab`` and
  ``dequant``).
* ``swap_ab`` (small M on Hopper): the same tensor-core kernel with the operands swapped, the weight tile
  as the MMA's A operand (from registers) and the tokens as its N (:mod:`.w4a16_tiled`).
* ``dequant`` (large M, compute-bound): dequantize W once into a dense ``[N, K]`` tensor with a
  Triton kernel and hand the GEMM to torch (cuBLAS).

Split-K programs write fp32 partial sums to a ``[split, M, N]`` workspace and one reduction kernel
adds them in split order, adds the bias and casts to ``x.dtype``: deterministic (no atomics), and
two launches where atomics into a zeroed buffer needed three (zero-fill, GEMM, cast). At M=1 split-K
is the rule, four times per decoder layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import switches
from .launch_utils import (
    COMPILE_OPTIONS,
    FLOAT_DTYPES,
    check_device,
    interpreting,
    next_pow2,
    num_sms,
    upcast_dot,
)
from .pdl import pdl_launch, pdl_start
from .split_k import SplitKPartials
from .split_k_jit import sum_split_k
from .w4_decode import (
    NIBBLE_MASK,
    decode_minus_zero,
    k_split_begin,
    k_step_scales,
    nibble_minus_zero,
    scale_rows,
    split_columns_mod4,
    store_output,
)
from .w4_layout import check_integer_zeros
from .w4a16_tiled import w4a16_tiled_kernel
from .w4a16_tuning import W4Launch, check_launch, tuned_launch

# ----------------------------------------------------------------------------- crossovers
# The built-in choices: what runs where no tuned file (w4a16_tuning) covers the GPU and shape.
# PROVISIONAL: read off one H200 run of bench/kernels/gpu_kernels.py (bench/results/gpu_kernels.json: gemv_us /
# tiled_us / dequant_us per shape and M, CUDA-graph timed). GEMV beat tiled at M <= 2 on all 8 Llama
# shapes; tiled beat dequant+cuBLAS at M=64 on 6 of 8 and at M=128 on 2 of 8. Re-measure on a
# consumer card (sm_86/89) and whenever a kernel changes.
GEMV_MAX_M = 2  # M <= GEMV_MAX_M: split-K GEMV (each weight unpacked once, reused for M rows)
TILED_MAX_M = 64  # GEMV_MAX_M < M <= TILED_MAX_M: tensor-core tiles; above: dequantize + cuBLAS
MAX_SPLIT_K = 16
GEMV_FORCED_MAX_M = 16  # the GEMV unrolls over rows: beyond this (forced by tests/bench only) it is pointless
GEMV_WAVES = 8  # GEMV programs are small and latency-bound: keep many per SM (H200 sweep: more splits won)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# Every path subtracts a fractional zero point exactly (``integer_zeros=False``, the default). The GGUF loader
# reads this to put Q4_1 / Q4_K tensors (z = -m / d) on the W4 kernels (lightinfer/formats/gguf_load.py).
FRACTIONAL_ZEROS = True


@dataclass(frozen=True)
class GemvConfig:
    """GEMV tile: ``block_n`` output rows x one quantization group of K per loop step (``block_n_single``
    rows when M == 1, if set); ``num_stages`` the depth of the loop's software pipeline (``tl.range``:
    groups of weights in flight + 1; 1 = none)."""

    group_size: int
    block_n: int
    num_warps: int
    num_stages: int
    block_n_single: int | None = None

    def rows(self, block_m: int) -> int:
        """Output rows per program for ``block_m`` rows of x."""
        return self.block_n_single if block_m == 1 and self.block_n_single else self.block_n


@dataclass(frozen=True)
class TiledConfig:
    """Tensor-core tile ``[block_m, block_n]``, K step ``min(block_k, G)`` (one group per step)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# BLOCK_N x G = 8K weights per program and step whatever G is (64 per thread at 4 warps). Larger tiles
# need fewer instructions per weight but more registers and fewer programs: bench/kernels/tune_w4a16.py times
# the choices per shape (not yet run on a GPU for the current kernel). At M=1 the tile
# is twice as tall (16K weights per step): x is converted once per step and reused by twice the rows
# (sm_90 loop with Triton 3.6, G=128 / 64 / 32: 5.61 / 5.34 / 5.50 -> 4.61 / 4.66 / 4.68 instructions
# per weight; with 3.9: 4.81 / 5.61 / 5.88 -> 4.26 / 4.83 / 4.73; 96-128 registers, no spills on
# sm_90 or sm_86), and with the weights pipelined fewer programs still keep ~16 KB each in flight.
# M=2 keeps the shorter tile: at G=128 the taller one needs 214-248 registers.
GEMV_CONFIGS: list[GemvConfig] = [
    GemvConfig(group_size=32, block_n=256, num_warps=4, num_stages=3, block_n_single=512),
    GemvConfig(group_size=64, block_n=128, num_warps=4, num_stages=3, block_n_single=256),
    GemvConfig(group_size=128, block_n=64, num_warps=4, num_stages=3, block_n_single=128),
]
# Picked by M: the smallest block_m >= M (tl.dot needs tiles >= 16).
TILED_CONFIGS: list[TiledConfig] = [
    TiledConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
    TiledConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3),
    TiledConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    TiledConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
]
# Before Hopper (sm_80/86/89: mma.sync, 64K registers per SM) the 64-row tile at 4 warps needs 254
# registers per thread (``python -m lightinfer.kernels.audit.smem_check --arch 86``): one 4-warp block per
# SM, too few warps to hide memory latency. At 8 warps it needs 128. Chosen from register counts;
# not yet timed on a consumer card.
TILED_CONFIGS_PRE_HOPPER: list[TiledConfig] = [
    c if c.block_m < 64 else TiledConfig(c.block_m, c.block_n, c.block_k, num_warps=8, num_stages=c.num_stages)
    for c in TILED_CONFIGS
]
DEQUANT_BLOCK_N = 64
DEQUANT_NUM_WARPS = 4
# The dequant path dequantizes W in slabs of output rows of at most this many bytes, each handed
# to cuBLAS in turn: the whole dense weight at once (235 MB for Llama-3-8B's fused gate/up) would
# set the engine's activation peak, which on an 8 GiB card is KV cache lost. Slabs of >= 2,048
# rows keep each GEMM large enough for cuBLAS (unmeasured on a GPU so far: re-check the M >= 1024
# timings of bench/kernels/gpu_kernels.py).
DEQUANT_SLAB_BYTES = 32 * 2**20
REDUCE_BLOCK_N = 1024  # split-K reduction: columns per program
REDUCE_NUM_WARPS = 4


# ----------------------------------------------------------------------------- kernels


@triton.jit
def split_k_reduce_kernel(ws_ptr, bias_ptr, y_ptr, N, num_splits, stride_ws, stride_wm, stride_ym,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    # One program per (row, BLOCK_N columns).
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    y = sum_split_k(ws_ptr + m * stride_wm, bias_ptr, offs_n, n_mask, stride_ws, num_splits, HAS_BIAS,
                    y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + offs_n, y, mask=n_mask)


@triton.jit
def w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, stride_xm, stride_qn, stride_sg, stride_ym, stride_ys, num_groups, groups_per_split, nibble_mask,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, INTEGER_ZEROS: tl.constexpr = False,
):
    # Works on the packed words themselves, one nibble position at a time: no unpacked
    # [BLOCK_N, GROUP_SIZE] tile, and each (row, word) accumulates its 8 products in one FFMA
    # chain (a tl.sum tree over unpacked weights pairs them into FMUL + FFMA + FADD).
    # ``nibble_mask`` is 15, passed at run time so that the shifted masks are loop-invariant
    # registers: as literals ptxas re-materialises them before every LOP3 (kernels/audit/sass_stats.py).
    #
    # Loads run ahead of their use, so a program does not sit out a DRAM latency every group (the
    # H200 run of the version that loaded and used in the same step reached 33-35% of the copy
    # bandwidth, well below its instruction limit): the weight tile is software-pipelined by
    # ``tl.range(num_stages=NUM_STAGES)`` (cp.async into shared memory, NUM_STAGES - 1 groups in
    # flight), and scales and zeros, 2 bytes per thread and too narrow for cp.async, are loaded one
    # group ahead into registers. (Prefetching x too cost registers at G=32 and nothing at G=128: x
    # is 2 bytes per weight row and stays in L2.)
    WORDS: tl.constexpr = GROUP_SIZE // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # A K step is one group here (BLOCK_K = GROUP_SIZE).
    g_start, g_end, s_next, z_next = k_split_begin(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, N, stride_qn, stride_sg, pid_k,
                                                   num_groups, groups_per_split, GROUP_SIZE, GROUP_SIZE, USE_PDL,
                                                   PREFETCH)
    offs_w = tl.arange(0, WORDS)
    offs_i = tl.arange(0, 8)
    offs_m = tl.arange(0, BLOCK_M)
    m4, m8, m12, m16 = nibble_mask << 4, nibble_mask << 8, nibble_mask << 12, nibble_mask << 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in tl.range(g_start, g_end, num_stages=NUM_STAGES):
        s, z, s_next, z_next = k_step_scales(s_ptr, z_ptr, s_next, z_next, g, g_end, offs_n, n_mask, stride_sg,
                                             GROUP_SIZE, GROUP_SIZE)
        w = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (g * WORDS + offs_w)[None, :],
                    mask=n_mask[:, None], other=0)  # [BLOCK_N, WORDS]
        hi = w >> 12  # nibbles 5-7 at bits 8..19
        if INTEGER_ZEROS:  # c = 2^(23 - bit) + z: one FADD per weight
            c0, c4, c8, c12, c16 = z + 8388608.0, z + 524288.0, z + 32768.0, z + 2048.0, z + 128.0
        else:  # c = 2^(23 - bit), z subtracted after it (w4_decode: base + z would round z)
            c0, c4, c8, c12, c16 = 8388608.0, 524288.0, 32768.0, 2048.0, 128.0
        for m in tl.static_range(BLOCK_M):
            xg = tl.load(x_ptr + m * stride_xm + g * GROUP_SIZE + offs_w[:, None] * 8 + offs_i[None, :],
                         mask=(offs_w[:, None] * 0 + m) < M, other=0.0).to(tl.float32)  # [WORDS, 8]
            x04, x15, x26, x37 = split_columns_mod4(xg)
            x0, x4 = tl.split(x04)
            x1, x5 = tl.split(x15)
            x2, x6 = tl.split(x26)
            x3, x7 = tl.split(x37)
            t = nibble_minus_zero(w, nibble_mask, c0, z, 0, INTEGER_ZEROS) * x0[None, :]
            t += nibble_minus_zero(w, m4, c4, z, 4, INTEGER_ZEROS) * x1[None, :]
            t += nibble_minus_zero(w, m8, c8, z, 8, INTEGER_ZEROS) * x2[None, :]
            t += nibble_minus_zero(w, m12, c12, z, 12, INTEGER_ZEROS) * x3[None, :]
            t += nibble_minus_zero(w, m16, c16, z, 16, INTEGER_ZEROS) * x4[None, :]
            t += nibble_minus_zero(hi, m8, c8, z, 8, INTEGER_ZEROS) * x5[None, :]
            t += nibble_minus_zero(hi, m12, c12, z, 12, INTEGER_ZEROS) * x6[None, :]
            t += nibble_minus_zero(hi, m16, c16, z, 16, INTEGER_ZEROS) * x7[None, :]
            part = s * tl.sum(t, axis=1)  # [BLOCK_N]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    store_output(acc, bias_ptr, y_ptr, offs_m, offs_n, (offs_m[:, None] < M) & n_mask[None, :], n_mask, pid_k,
                 stride_ym, stride_ys, HAS_BIAS, SPLIT)


@triton.jit
def w4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sg, stride_wn, nibble_mask,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False, F16_DECODE: tl.constexpr = False, USE_PTX: tl.constexpr = False,
    INTEGER_ZEROS: tl.constexpr = False,
):
    pdl_start(USE_PDL)  # before any memory access (kernels/pdl.py)
    # One program: BLOCK_N rows x one group of K -> dense w [N, K] (nn.Linear orientation).
    WORDS: tl.constexpr = GROUP_SIZE // 8
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (g * WORDS + tl.arange(0, WORDS))[None, :],
                    mask=n_mask[:, None], other=0)
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    # fp16 output: pairs decoded and scaled two per instruction, the same bits as the fp32 decode
    w = scale_rows(decode_minus_zero(words, z, nibble_mask, GROUP_SIZE, F16_DECODE, USE_PTX, INTEGER_ZEROS), s,
                   w_ptr.dtype.element_ty, F16_DECODE)
    offs_k = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (offs_k[None, :] < K))


# ----------------------------------------------------------------------------- launcher


def _validate(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int, int, int]:
    """Check shapes/dtypes/devices/strides; returns ``(M, N, K, G)``. Raises ValueError."""
    if x.dim() != 2 or qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"w4a16_gemm: x, qweight, scales must be 2-D, got {x.dim()}, {qweight.dim()}, {scales.dim()}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"w4a16_gemm: x must be float16/bfloat16/float32, got {x.dtype}")
    if qweight.dtype != torch.int32:
        raise ValueError(f"w4a16_gemm: qweight must be int32 [N, K // 8], got {qweight.dtype}")
    if scales.dtype not in FLOAT_DTYPES or zeros.dtype not in FLOAT_DTYPES:
        raise ValueError(f"w4a16_gemm: scales/zeros must be float, got {scales.dtype}/{zeros.dtype}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] * 8 != k:
        raise ValueError(f"w4a16_gemm: x has K={k} but qweight {tuple(qweight.shape)} holds K={qweight.shape[1] * 8}")
    if n == 0 or n % 8:
        raise ValueError(f"w4a16_gemm: N={n} must be a positive multiple of 8")
    if scales.shape[1] != n or zeros.shape != scales.shape or scales.shape[0] == 0 or k % scales.shape[0]:
        raise ValueError(
            f"w4a16_gemm: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} must both be [K // G, N] "
            f"with K={k}, N={n}"
        )
    g = k // scales.shape[0]
    if g not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"w4a16_gemm: group size {g} (K={k} / {scales.shape[0]} groups) not in {SUPPORTED_GROUP_SIZES}")
    if bias is not None and (bias.shape != (n,) or bias.dtype not in FLOAT_DTYPES):
        raise ValueError(f"w4a16_gemm: bias must be a float [N={n}] tensor, got {tuple(bias.shape)} {bias.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"w4a16_gemm: x must be contiguous along K (strides {x.stride()})")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"w4a16_gemm: {name} must be contiguous (strides {t.stride()})")
    check_device("w4a16_gemm", x, qweight, scales, zeros, bias)
    return m, n, k, g


def gemv_config(group_size: int) -> GemvConfig:
    """The GEMV configuration used for ``group_size``."""
    return next(c for c in GEMV_CONFIGS if c.group_size == group_size)


def tiled_configs(device: torch.device) -> list[TiledConfig]:
    """:data:`TILED_CONFIGS` on sm_90/sm_100 and the CPU interpreter, :data:`TILED_CONFIGS_PRE_HOPPER` on
    other GPUs (sm_80/86/89 and sm_120)."""
    # wgmma (sm_90) and tcgen05 (sm_100) keep accumulators out of the way; everything else, consumer
    # Blackwell (sm_120) included, multiplies with mma.sync from registers like sm_80.
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return TILED_CONFIGS_PRE_HOPPER
    return TILED_CONFIGS


def tiled_config(m: int, device: torch.device | None = None) -> TiledConfig:
    """The tensor-core configuration used for ``m`` rows on ``device``: smallest ``block_m >= m`` (else the largest)."""
    configs = tiled_configs(device) if device is not None else TILED_CONFIGS
    return next((c for c in configs if c.block_m >= m), configs[-1])


def f16_decode(dtype: torch.dtype, scale_dtype: torch.dtype = torch.float16, ptx: bool | None = None, *,
               integer_zeros: bool = False) -> dict[str, bool]:
    """The tensor-core and dequant kernels' decode constexprs for activations (or output) of ``dtype``, scales of
    ``scale_dtype`` and zero points that are all integers (``integer_zeros``) or not: fp16 pairs (``F16_DECODE``,
    :func:`.w4_decode.unpack_minus_zero_f16`) when both dtypes are fp16 (an fp32 scale would be rounded to fp16
    before the multiply) and the zeros are integers (the pairs' one HADD2 rounds a fraction away), in PTX
    (``USE_PTX``) unless ``ptx`` says otherwise; by default everywhere but the CPU interpreter. Everything else
    keeps the fp32 decode (``INTEGER_ZEROS`` picks its exact form), and so does fp16 with
    ``LIGHTINFER_F16_DECODE=0`` (``switches.py``: for comparing the two on a GPU)."""
    on = integer_zeros and dtype == torch.float16 and scale_dtype == torch.float16 and switches.current().f16_decode
    return {"F16_DECODE": on, "USE_PTX": not interpreting() if ptx is None else ptx, "INTEGER_ZEROS": integer_zeros}


def pick_path(m: int) -> str:
    """``"gemv"``, ``"tiled"`` or ``"dequant"`` for ``m`` rows (crossovers at the top of this file)."""
    return "gemv" if m <= GEMV_MAX_M else ("tiled" if m <= TILED_MAX_M else "dequant")


def _split_k(num_programs_mn: int, num_k_steps: int, device: torch.device, waves: int = 2) -> int:
    # Aim for about ``waves`` programs per SM; never create an empty split.
    target = waves * num_sms(device)
    if num_programs_mn >= target:
        return 1
    split = min(triton.cdiv(target, num_programs_mn), num_k_steps, MAX_SPLIT_K)
    return triton.cdiv(num_k_steps, triton.cdiv(num_k_steps, split))


def pick_split_k(m: int, n: int, k: int, group_size: int, path: str, device: torch.device) -> int:
    """The split-K factor the built-in launch uses for this problem on ``path`` ("gemv" or "tiled")."""
    launch = default_launch(m, n, k, group_size, device, path)
    grid_m = 1 if path == "gemv" else triton.cdiv(m, launch.block_m)
    return _split_k(grid_m * triton.cdiv(n, launch.block_n), k // launch.block_k, device,
                    GEMV_WAVES if path == "gemv" else 2)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                  integer_zeros: bool = False) -> torch.Tensor:
    """Run-time layout -> dense ``[N, K]`` weight in ``dtype`` (Triton twin of ``reference.dequantize_w4``);
    ``integer_zeros`` as in :func:`w4a16_gemm`."""
    w = torch.empty((qweight.shape[0], qweight.shape[1] * 8), dtype=dtype, device=qweight.device)
    _dequantize_into(w, qweight, scales, zeros, integer_zeros)
    return w


def _dequantize_into(w: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     integer_zeros: bool) -> None:
    """Dequantize into ``w [N, K]`` (row stride free; ``qweight`` rows and ``scales``/``zeros``
    columns may be slices of a larger layer: only the row strides are used)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    g = k // scales.shape[0]
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), k // g)
    w4_dequant_kernel[grid](qweight, scales, zeros, w, n, k, qweight.stride(0), scales.stride(0), w.stride(0), NIBBLE_MASK,
                            GROUP_SIZE=g, BLOCK_N=DEQUANT_BLOCK_N, num_warps=DEQUANT_NUM_WARPS,
                            **f16_decode(w.dtype, scales.dtype, integer_zeros=integer_zeros), **pdl_launch(w.device),
                            **COMPILE_OPTIONS)


def dequant_slab_rows(n: int, k: int, elem_bytes: int) -> int:
    """Output rows per dequantized slab (:data:`DEQUANT_SLAB_BYTES`), a multiple of the dequant
    kernel's ``DEQUANT_BLOCK_N`` and of 8, at least one block, at most ``n``."""
    rows = DEQUANT_SLAB_BYTES // max(1, k * elem_bytes) // DEQUANT_BLOCK_N * DEQUANT_BLOCK_N
    return min(n, max(DEQUANT_BLOCK_N, rows))


def _dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None, integer_zeros: bool) -> torch.Tensor:
    """Large M: dequantize W slab by slab (one reused buffer) and let cuBLAS multiply each slab."""
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    rows = dequant_slab_rows(n, k, x.element_size())
    b = None if bias is None else bias.to(x.dtype)
    if rows >= n:
        return torch.nn.functional.linear(x, dequantize_w4(qweight, scales, zeros, x.dtype, integer_zeros), b)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    slab = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = slab[: n1 - n0]
        _dequantize_into(w, qweight[n0:n1], scales[:, n0:n1], zeros[:, n0:n1], integer_zeros)
        y[:, n0:n1] = torch.nn.functional.linear(x, w, None if b is None else b[n0:n1])
    return y


def default_launch(m: int, n: int, k: int, group_size: int, device: torch.device, path: str | None = None) -> W4Launch:
    """The built-in launch for ``m`` rows (``path`` forced or by :func:`pick_path`), split-K left to the heuristic."""
    path = path or pick_path(m)
    if path == "dequant":
        return W4Launch("dequant")
    if path == "gemv":
        cfg = gemv_config(group_size)
        block_m = next_pow2(m)
        return W4Launch("gemv", block_m, cfg.rows(block_m), group_size, cfg.num_warps, cfg.num_stages)
    if path == "tiled":
        t = tiled_config(m, device)
        return W4Launch("tiled", t.block_m, t.block_n, min(t.block_k, group_size), t.num_warps, t.num_stages)
    if path == "swap_ab":  # only by request (tests, bench) or from a tuned file: not timed on a GPU yet
        block_m = min(max(16, next_pow2(m)), 64)
        return W4Launch("swap_ab", block_m, 64 if block_m <= 32 else 128, min(128 if block_m <= 32 else 64, group_size),
                        4, 3)
    raise ValueError(f"w4a16_gemm: unknown path {path!r}")


def choose_launch(m: int, n: int, k: int, group_size: int, device: torch.device) -> W4Launch:
    """The launch :func:`w4a16_gemm` uses: the device's tuned entry (:mod:`.w4a16_tuning`), else the built-in one."""
    launch = tuned_launch(device, m, n, k, group_size)
    if launch is None or (launch.path == "gemv" and m > GEMV_FORCED_MAX_M):
        return default_launch(m, n, k, group_size, device)
    return launch


def w4a16_gemm_path(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    path: str | None = None,
    split_k: int | None = None,
    launch: W4Launch | None = None,
    defer_reduce: bool = False,
    integer_zeros: bool = False,
) -> torch.Tensor | SplitKPartials:
    """:func:`w4a16_gemm` with the path (``"gemv"|"tiled"|"swap_ab"|"dequant"``), split-K or the whole launch forced
    (tests, bench, the tuner). Without any, the launch is :func:`choose_launch`'s. The launch does not depend on
    ``integer_zeros`` (the decode does): tuned launches serve both kinds of zero points.

    Raises:
        ValueError: bad inputs (see :func:`w4a16_gemm`) or a launch the kernels cannot run.
    """
    m, n, k, g = _validate(x, qweight, scales, zeros, bias)
    if integer_zeros and zeros.device.type != "cuda":  # held to account where it is free (no device sync)
        check_integer_zeros(zeros)
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if launch is None:
        launch = choose_launch(m, n, k, g, x.device) if path is None else default_launch(m, n, k, g, x.device, path)
    else:
        check_launch(launch, g)
    if split_k is not None:
        launch = dataclasses.replace(launch, split_k=split_k)
    if launch.path == "dequant":
        return _dequant_matmul(x, qweight, scales, zeros, bias, integer_zeros)
    if launch.path == "gemv":
        if m > GEMV_FORCED_MAX_M:
            raise ValueError(f"w4a16_gemm: gemv path handles at most {GEMV_FORCED_MAX_M} rows, got M={m}")
        block_m = next_pow2(m)  # the GEMV unrolls over exactly the rows it has
        grid_mn = (1, triton.cdiv(n, launch.block_n))
    else:  # tiled / swap_ab
        block_m = launch.block_m
        grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, launch.block_n))
    block_n, block_k = launch.block_n, launch.block_k
    num_k_steps = k // block_k
    split = launch.split_k or _split_k(grid_mn[0] * grid_mn[1], num_k_steps, x.device,
                                       GEMV_WAVES if launch.path == "gemv" else 2)
    split = min(split, num_k_steps)
    steps_per_split = triton.cdiv(num_k_steps, split)
    split = triton.cdiv(num_k_steps, steps_per_split)
    # Split-K: the kernel writes fp32 partials to out [split, M, N] (the reduction, or the op that takes
    # them, makes y); otherwise it writes y itself.
    out = torch.empty((split, m, n) if split > 1 else (m, n), dtype=torch.float32 if split > 1 else x.dtype,
                      device=x.device)
    bias_arg = bias if bias is not None else x  # unused pointer of the dtype a bias would have
    common = {"HAS_BIAS": bias is not None, "SPLIT": split > 1, "num_warps": launch.num_warps,
              "num_stages": launch.num_stages, **pdl_launch(x.device, prefetch=True), **COMPILE_OPTIONS}
    if launch.path == "gemv":
        w4a16_gemv_kernel[(grid_mn[1], split)](
            x, qweight, scales, zeros, bias_arg, out, m, n, x.stride(0), qweight.stride(0), scales.stride(0),
            n, m * n, num_k_steps, steps_per_split, NIBBLE_MASK, GROUP_SIZE=g, BLOCK_M=block_m, BLOCK_N=block_n,
            NUM_STAGES=launch.num_stages, INTEGER_ZEROS=integer_zeros, **common)
    else:  # tiled / swap_ab: one kernel, the operand order a constexpr (kernels/w4a16_tiled.py)
        swap = launch.path == "swap_ab"
        w4a16_tiled_kernel[(grid_mn[1], grid_mn[0], split) if swap else (grid_mn[0], grid_mn[1], split)](
            x, qweight, scales, zeros, bias_arg, out, m, n, x.stride(0), qweight.stride(0), scales.stride(0),
            n, m * n, num_k_steps, steps_per_split, NIBBLE_MASK, GROUP_SIZE=g, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, UPCAST_DOT=upcast_dot(x.dtype), SWAP_AB=swap,
            **f16_decode(x.dtype, scales.dtype, integer_zeros=integer_zeros), **common)
    if split == 1:
        return out
    if defer_reduce:
        return SplitKPartials(out, bias, x.dtype)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split_k_reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK_N))](
        out, bias_arg, y, n, split, m * n, n, n, HAS_BIAS=bias is not None, BLOCK_N=REDUCE_BLOCK_N,
        num_warps=REDUCE_NUM_WARPS, **pdl_launch(x.device), **COMPILE_OPTIONS)
    return y


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    defer_reduce: bool = False,
    integer_zeros: bool = False,
) -> torch.Tensor | SplitKPartials:
    """``y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias)``, fp32 accumulation, returned in ``x.dtype``.

    Args:
        x: ``[M, K]`` float16/bfloat16 (float32 accepted for the CPU interpreter), stride 1 along K.
        qweight: int32 ``[N, K // 8]`` contiguous, run-time layout (module docstring).
        scales, zeros: float ``[K // G, N]`` contiguous, G in 32/64/128. Zero points may be fractional
            (GGUF Q4_1 / Q4_K): every path subtracts them exactly, in fp32.
        bias: optional float ``[N]``.
        defer_reduce: when K is split, return the unreduced :class:`SplitKPartials` for an op that
            sums them as it loads them (``fused_add_rms_norm``, ``silu_and_mul``): one launch less.
        integer_zeros: the caller knows every zero point is an integer (AWQ, GPTQ, compressed-tensors,
            Q4_0: ``W4A16Linear.integer_zeros``): the cheaper decode, one FADD per weight or fp16 pairs
            (module docstring). Checked on the CPU only (a GPU check would need a device sync): there a
            fraction would be rounded away.
    Returns:
        ``[M, N]`` in ``x.dtype``, or with ``defer_reduce`` and a split K, :class:`SplitKPartials`.
    Raises:
        ValueError: bad shapes, dtypes, strides or devices (CPU needs ``TRITON_INTERPRET=1``), or on the
            CPU ``integer_zeros=True`` with a fractional zero point.
    """
    return w4a16_gemm_path(x, qweight, scales, zeros, bias, defer_reduce=defer_reduce, integer_zeros=integer_zeros)
