"""Exact 4-bit weight decode for the W4A16 kernels (run-time layout: ``reference`` module docstring), and the
L2 prefetch of a program's weight slice that they issue under programmatic dependent launch.

A nibble at bit ``p`` of an int32 word, masked in place and OR-ed with the float32 exponent of
``2^(23 - p)``, reads as exactly ``2^(23 - p) + q``; subtracting ``2^(23 - p) + z`` gives ``q - z``.
So decoding a weight costs one LOP3 and one FADD: no shift, bit-field extract or int->float
conversion. The float mantissa has 23 bits, so nibbles 0-4 are read in place and 5-7 after one
shift of the word by 12. ``python -m lightinfer.kernels.sass_stats`` counts the result.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import prefetch_l2

# Passed to every kernel as a run-time argument, never written as a literal in them: a run-time value
# makes the shifted masks loop-invariant registers, where literals get re-materialised by ptxas
# before every LOP3 that uses them (one extra MOV per weight; ``kernels/sass_stats.py`` shows it).
NIBBLE_MASK = 15


@triton.jit
def unpack_minus_zero(words, z, nibble_mask, BLOCK_K: tl.constexpr):
    """int32 words ``[R, BLOCK_K // 8]``, zero points ``z [R]`` -> exact fp32 ``q - z`` ``[R, BLOCK_K]``
    (k = 8 j + i: nibble i of word j).

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
    (``python -m lightinfer.kernels.sass_stats`` counts them).
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
    return bits.to(tl.float32, bitcast=True) - (base[None, :] + z[:, None])


@triton.jit
def split_columns_mod4(x):
    """``[W, 8]`` -> four ``[W, 2]`` tensors holding columns (0, 4), (1, 5), (2, 6), (3, 7)."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 4, 2)))  # even / odd columns: (0,2,4,6), (1,3,5,7)
    a0, a1 = tl.split(tl.reshape(a, (x.shape[0], 2, 2)))  # (0,4), (2,6)
    b0, b1 = tl.split(tl.reshape(b, (x.shape[0], 2, 2)))  # (1,5), (3,7)
    return a0, b0, a1, b1


@triton.jit
def nibble_minus_zero(src, mask, c, BIT: tl.constexpr):
    """``q - z`` (exact fp32) of the nibble at bits ``BIT..BIT+3`` of every int32 in ``src [R, W]``;
    ``mask = 15 << BIT``, ``c [R] = 2^(23 - BIT) + z`` (see :func:`unpack_minus_zero`)."""
    bits = (src & mask) | ((150 - BIT) << 23)
    return bits.to(tl.float32, bitcast=True) - c[:, None]


@triton.jit
def prefetch_weight_rows(qw_ptr, offs_n, N, stride_qn, w_start, w_end):
    """Pull words ``[w_start, w_end)`` of weight rows ``offs_n`` into L2 (one prefetch per 128-byte line and
    row; no registers, no wait). Called before :func:`pdl_start`'s wait under programmatic dependent launch:
    weights are never written, so a program launched early streams its slice of them while the previous
    kernel (a norm, the attention) is still running, and its loop then reads them from L2."""
    base = qw_ptr + tl.minimum(offs_n, N - 1) * stride_qn + w_start
    for w in range(0, w_end - w_start, 32):
        prefetch_l2(base + w)
    prefetch_l2(base + (w_end - w_start - 1))  # the last line, when the slice does not start on one
