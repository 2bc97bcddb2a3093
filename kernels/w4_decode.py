"""Pieces shared by the W4A16 kernels: exact 4-bit weight decode (run-time layout: ``w4_layout`` module
docstring), the K-split prologue with its L2 prefetch under programmatic dependent launch, the scale/zero
prefetch of a K step, and the output store.

A nibble at bit ``p`` of an int32 word, masked in place and OR-ed with the float32 exponent of
``2^(23 - p)``, reads as exactly ``2^(23 - p) + q``; subtracting ``2^(23 - p) + z`` gives ``q - z``.
So decoding a weight costs one LOP3 and one FADD: no shift, bit-field extract or int->float
conversion. The float mantissa has 23 bits, so nibbles 0-4 are read in place and 5-7 after one
shift of the word by 12. ``python -m lightinfer.kernels.audit.sass_stats`` counts the result.

That single FADD is exact only for an integer zero point: ``2^(23 - p) + z`` has a mantissa unit of
``2^-p``, so a fractional z (GGUF Q4_1 / Q4_K: ``z = -m / d``) would lose its low bits (at ``p = 0``,
all of its fraction). Every decode therefore takes an ``INTEGER_ZEROS`` constexpr: True (AWQ, GPTQ,
compressed-tensors, Q4_0; what the launcher is promised) keeps the one FADD; False subtracts the bias
and then z, two FADDs, each exact (``2^(23 - p) + q - 2^(23 - p)`` is the integer q, and ``q - z`` is
rounded only by fp32 itself, as in the reference dequantization).

The tensor-core kernels with fp16 activations decode two weights per instruction instead
(:func:`unpack_minus_zero_f16`): the same exponent trick on both 16-bit halves of a register gives an
fp16 pair, which is the MMA operand's own format. Triton does 16-bit integer work one element at a
time (an ``and``/``or`` per weight and PRMTs to pack the pairs: tried, 7.0 instructions per weight), so
the pair decode is nine PTX instructions per word in ``tl.inline_asm_elementwise``
(:func:`decode_minus_zero` picks the decode, :func:`scale_rows` applies the scale in the same precision).
Its one HADD2 subtracts ``1024 + z``, whose fp16 unit is 1: integer zeros only (fractional zeros take the
fp32 decode; the launcher decides, ``w4a16_gemm.f16_decode``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_start, prefetch_l2

# Passed to every kernel as a run-time argument, never written as a literal in them: a run-time value
# makes the shifted masks loop-invariant registers, where literals get re-materialised by ptxas
# before every LOP3 that uses them (one extra MOV per weight; ``kernels/audit/sass_stats.py`` shows it).
NIBBLE_MASK = 15


@triton.jit
def unpack_minus_zero(words, z, nibble_mask, BLOCK_K: tl.constexpr, INTEGER_ZEROS: tl.constexpr):
    """int32 words ``[R, BLOCK_K // 8]``, zero points ``z [R]`` -> exact fp32 ``q - z`` ``[R, BLOCK_K]``
    (k = 8 j + i: nibble i of word j). ``INTEGER_ZEROS``: every z is an integer (one FADD per weight);
    False: any z (two, see the module docstring).

    ``tl.interleave`` (join + reshape) keeps the copies of a word in the thread that loaded it, so
    unpacking needs no shuffles or shared memory (a 3-D ``[R, W, 8]`` broadcast spreads the nibble
    axis over lanes: on an H200 the tiled path at M=4096 went from ~3.1 to ~1.1 ms when interleaving
    replaced it).

    No int->float conversion (I2F runs at a quarter rate on sm_80..sm_90) and no shift per nibble:
    a nibble at bit ``p`` is masked in place and OR-ed with the exponent of ``2^(23 - p)``, whose
    mantissa unit is then ``2^-p``: the float is exactly ``2^(23 - p) + q``. Subtracting
    ``2^(23 - p) + z`` (exact for an integer z in 0..15: both are integers below 2^24; a
    fractional z would be rounded) gives ``q - z`` in one FADD. The
    mantissa has 23 bits, so nibbles 0-4 (bits 0..19) are read in place and nibbles 5-7 after one
    shift of the word by 12 (bits 8..19). Per weight: one LOP3 and one FADD in SASS
    (``python -m lightinfer.kernels.audit.sass_stats`` counts them).
    """
    rep = tl.interleave(words, words)
    rep = tl.interleave(rep, rep)
    rep = tl.interleave(rep, rep)  # [R, BLOCK_K]: each word 8 times
    nib = tl.arange(0, BLOCK_K) % 8
    pre = tl.where(nib >= 5, 12, 0)  # nibbles 5-7: shift the word once so they sit at bits 8..19
    bit = nib * 4 - pre  # where the nibble sits in the (shifted) word: 0, 4, ..., 16
    exp_bits = (150 - bit) << 23  # biased exponent of 2^(23 - bit)
    bits = ((rep >> pre[None, :]) & (nibble_mask << bit)[None, :]) | exp_bits[None, :]
    base = (exp_bits + 0).to(tl.float32, bitcast=True)  # 2^(23 - bit)
    if INTEGER_ZEROS:
        qz = bits.to(tl.float32, bitcast=True) - (base[None, :] + z[:, None])
    else:  # base + z would round z's fraction away: q first (exact), then q - z
        qz = (bits.to(tl.float32, bitcast=True) - base[None, :]) - z[:, None]
    return qz


# Word w (nibble i = code of k = 8j + i: byte b holds k = 2b in bits 0-3, k = 2b + 1 in bits 4-7) -> four fp16
# pairs, k = 2b in the low half of a result and k = 2b + 1 in the high half, both at bit 0 of their half and
# read as fp16 1024 + q with the exponent trick of the module docstring (an fp16 mantissa has 10 bits):
#   v = w >> 4                                  byte b of v holds k = 2b + 1 in bits 0-3
#   u = prmt(w, v, 0x(4+b)(4+b)bb)              low half: byte b of w twice; high half: byte b of v twice
#   (u & 0x000F000F) | 0x64006400 = (1024 + q(2b), 1024 + q(2b + 1))
# One base for both halves: the pair subtract takes (1024 + z) twice, a register made once per row.
# lop3 LUT 0xea is (a & b) | c. Outputs $0..$7 are k = 0..7 (tests/kernels/test_w4_decode_ptx.py runs this
# program instruction by instruction on words with every code at every nibble).
def _pair_decode_ptx() -> str:
    """The PTX block above: the shift, then per byte b a permute, a mask-and-exponent LOP3 and the split of the
    pair into outputs ``$2b`` and ``$2b+1``."""
    lines = [".reg .b32 v, t;", "shr.u32 v, $8, 4;"]
    for b in range(4):
        lines += [f"prmt.b32 t, $8, v, 0x{4 + b}{4 + b}{b}{b};", "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xea;",
                  f"mov.b32 {{${2 * b}, ${2 * b + 1}}}, t;"]
    return "{\n" + "\n".join(lines) + "\n}"


F16_PAIR_DECODE_PTX = tl.constexpr(_pair_decode_ptx())


@triton.jit
def unpack_minus_zero_f16(words, z, BLOCK_K: tl.constexpr, USE_PTX: tl.constexpr):
    """int32 words ``[R, BLOCK_K // 8]``, zero points ``z [R]`` (any float dtype, integers 0..15 only: a fraction
    is rounded away) -> exact fp16 ``q - z`` ``[R, BLOCK_K]`` (k = 8 j + i: nibble i of word j), two weights per
    instruction.

    With ``USE_PTX`` (a GPU; sm_53+ for the fp16 pair subtract) a shift, four PRMT and four LOP3 per word give
    the eight codes as fp16 ``1024 + q`` (:data:`F16_PAIR_DECODE_PTX`); one HADD2 per pair subtracts
    ``1024 + z`` (exact: integers below 2048). The pairs stay in the registers they were made in: the MMA
    operand layout holds k and k + 1 in one register too (sm_90, Triton 3.6, swap_ab 16 x 64: 4.86 -> 3.81
    instructions per weight). Without it the same values come from plain Triton (interpreter).
    """
    if USE_PTX:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            F16_PAIR_DECODE_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 8, is_pure=True,
            pack=1)
        # Joined: [R, W, c, b, a] holds o_(4a + 2b + c); permuted to [R, W, a, b, c] it reshapes to
        # k = 8 j + 4a + 2b + c.
        t = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
        biased = tl.reshape(tl.permute(t, (0, 1, 4, 3, 2)), (t.shape[0], BLOCK_K))
    else:  # the same values in plain Triton: the CPU interpreter cannot run PTX
        nibbles = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 15
        biased = tl.reshape(nibbles.to(tl.float16) + 1024.0, (words.shape[0], BLOCK_K))
    return biased - (z.to(tl.float16) + 1024.0)[:, None]


@triton.jit
def decode_minus_zero(words, z, nibble_mask, BLOCK_K: tl.constexpr, F16_DECODE: tl.constexpr, USE_PTX: tl.constexpr,
                      INTEGER_ZEROS: tl.constexpr):
    """Exact ``q - z`` ``[R, BLOCK_K]`` of int32 words ``[R, BLOCK_K // 8]``: fp16 pairs with ``F16_DECODE``
    (:func:`unpack_minus_zero_f16`; integer zeros only), else fp32 (:func:`unpack_minus_zero`)."""
    tl.static_assert(INTEGER_ZEROS or not F16_DECODE, "the fp16 pair decode rounds fractional zero points")
    if F16_DECODE:
        qz = unpack_minus_zero_f16(words, z, BLOCK_K, USE_PTX)
    else:
        qz = unpack_minus_zero(words, z, nibble_mask, BLOCK_K, INTEGER_ZEROS)
    return qz


@triton.jit
def scale_rows(qz, s, dtype: tl.constexpr, F16_DECODE: tl.constexpr):
    """``(q - z) * s`` per weight row (``s [R]`` fp32) in ``dtype``. An fp16 ``q - z`` (at most 5 significant bits)
    times an fp16 scale is rounded once either way, so the fp16 multiply (HMUL2: two weights per instruction)
    gives the same bits as the fp32 product rounded to fp16."""
    if F16_DECODE:
        w = qz * s.to(tl.float16)[:, None]
    else:
        w = (qz * s[:, None]).to(dtype)
    return w


@triton.jit
def split_columns_mod4(x):
    """``[W, 8]`` -> four ``[W, 2]`` tensors holding columns (0, 4), (1, 5), (2, 6), (3, 7)."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 4, 2)))  # even / odd columns: (0,2,4,6), (1,3,5,7)
    a0, a1 = tl.split(tl.reshape(a, (x.shape[0], 2, 2)))  # (0,4), (2,6)
    b0, b1 = tl.split(tl.reshape(b, (x.shape[0], 2, 2)))  # (1,5), (3,7)
    return a0, b0, a1, b1


@triton.jit
def nibble_minus_zero(src, mask, c, z, BIT: tl.constexpr, INTEGER_ZEROS: tl.constexpr):
    """``q - z`` (exact fp32) of the nibble at bits ``BIT..BIT+3`` of every int32 in ``src [R, W]``;
    ``mask = 15 << BIT``. ``INTEGER_ZEROS``: ``c [R] = 2^(23 - BIT) + z`` (one FADD; ``z`` unused); else
    ``c = 2^(23 - BIT)`` (a scalar) and ``z [R]`` subtracted after it (see :func:`unpack_minus_zero`)."""
    bits = (src & mask) | ((150 - BIT) << 23)
    if INTEGER_ZEROS:
        qz = bits.to(tl.float32, bitcast=True) - c[:, None]
    else:
        qz = (bits.to(tl.float32, bitcast=True) - c) - z[:, None]
    return qz


@triton.jit
def prefetch_weight_rows(qw_ptr, offs_n, N, stride_qn, w_start, w_end):
    """Pull words ``[w_start, w_end)`` of weight rows ``offs_n`` into L2 (one prefetch per 128-byte line and
    row; no registers, no wait). Called before :func:`.pdl.pdl_start`'s wait under programmatic dependent
    launch: weights are never written, so a program launched early fetches the words it reads first while
    the previous kernel (a norm, the attention) is still running (:func:`k_split_begin` says how many)."""
    base = qw_ptr + tl.minimum(offs_n, N - 1) * stride_qn + w_start
    for w in range(0, w_end - w_start, 32):
        prefetch_l2(base + w)
    prefetch_l2(base + (w_end - w_start - 1))  # the last line, when the slice does not start on one


@triton.jit
def k_split_begin(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, N, stride_qn, stride_sg, pid_k, num_k_steps, steps_per_split,
                  GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Start of a W4 GEMM program's K loop: its steps ``[t_start, t_end)`` of ``BLOCK_K`` (a divisor of the
    group size), and the first step's scales and zeros, loaded ahead (:func:`k_step_scales`). With
    ``PREFETCH`` (under PDL) the program's first two K steps of weights are asked of L2 first: what the
    software pipeline would otherwise wait for at the start, and little enough (a few MB over a whole grid)
    not to evict what the kernel before it is still reading. Then :func:`.pdl.pdl_start` waits: every load
    here and after it follows the wait. Returns ``(t_start, t_end, s_next, z_next)``."""
    t_start = pid_k * steps_per_split
    t_end = tl.minimum(t_start + steps_per_split, num_k_steps)  # the launchers never make an empty split
    if PREFETCH:
        prefetch_weight_rows(qw_ptr, offs_n, N, stride_qn, t_start * (BLOCK_K // 8),
                             tl.minimum(t_end, t_start + 2) * (BLOCK_K // 8))
    pdl_start(USE_PDL)
    STEPS_PER_GROUP: tl.constexpr = GROUP_SIZE // BLOCK_K  # (t * BLOCK_K) // GROUP_SIZE costs an SGXT
    s_next = tl.load(s_ptr + (t_start // STEPS_PER_GROUP) * stride_sg + offs_n, mask=n_mask, other=0.0)
    z_next = tl.load(z_ptr + (t_start // STEPS_PER_GROUP) * stride_sg + offs_n, mask=n_mask, other=0.0)
    return t_start, t_end, s_next, z_next


@triton.jit
def k_step_scales(s_ptr, z_ptr, s_next, z_next, t, t_end, offs_n, n_mask, stride_sg,
                  GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step ``t``'s scales and zeros in fp32 (loaded one step earlier), and the next step's loads issued now:
    2 bytes per thread, too narrow for cp.async, so their DRAM latency overlaps a step of work this way
    (the last step re-reads its own group: in bounds, unused). Returns ``(s, z, s_next, z_next)``."""
    s = s_next.to(tl.float32)
    z = z_next.to(tl.float32)
    g_ahead = tl.minimum(t + 1, t_end - 1) // (GROUP_SIZE // BLOCK_K)
    s_next = tl.load(s_ptr + g_ahead * stride_sg + offs_n, mask=n_mask, other=0.0)
    z_next = tl.load(z_ptr + g_ahead * stride_sg + offs_n, mask=n_mask, other=0.0)
    return s, z, s_next, z_next


@triton.jit
def store_output(acc, bias_ptr, y_ptr, offs_m, offs_n, y_mask, n_mask, pid_k, stride_ym, stride_ys,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """``acc [BLOCK_M, BLOCK_N]`` fp32 -> ``y`` (+ bias, in y's dtype), or, split-K, this split's fp32 slice of
    the ``[split, M, N]`` workspace (bias and cast left to the split-K reduction)."""
    if SPLIT:
        tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=y_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)
