"""GGUF quantized blocks -> integer codes with a scale and a zero per group, exactly.

Every block type handled here is affine per group: ``w = (code - zero) * scale`` with integer
codes, one ``scale`` and one ``zero`` per group of 16 or 32 consecutive weights of a row. So a
GGUF tensor maps onto lightinfer's W4 (4-bit codes) or W8 (int8 codes) run-time layouts without
re-quantizing: the codes are the file's own, and the scale and zero are derived in fp32.

Block layouts (llama.cpp ``ggml-common.h``; ``d``, ``dmin``, ``m`` are fp16, little-endian):

===========  ======  =====================================================  =====================
type         bytes   block                                                   weight
===========  ======  =====================================================  =====================
Q4_0         18      d, qs[16]: element j low nibble, j + 16 high nibble     d * (q - 8)
Q4_1         20      d, m, qs[16] (as Q4_0)                                  d * q + m
Q4_K         144     d, dmin, scales[12] (8 x 6-bit sc and m), qs[128]       d*sc_j * q - dmin*m_j
Q5_0         22      d, qh[4] (bit j: 5th bit of element j), qs[16]          d * (q - 16)
Q5_1         24      d, m, qh[4], qs[16]                                     d * q + m
Q5_K         176     d, dmin, scales[12], qh[32], qs[128]                    d*sc_j * q - dmin*m_j
Q6_K         210     ql[128], qh[64], scales[16] (int8), d                   d*sc_j * (q - 32)
Q8_0         34      d, qs[32] (int8)                                        d * q
===========  ======  =====================================================  =====================

K-quants are super-blocks of 256: Q4_K/Q5_K have 8 sub-blocks of 32 (the group), Q6_K 16 of 16.
Each unpacker is checked against the ``gguf`` package's own dequantizer (tests/formats).

Zero points: for ``d * q + m`` the zero is ``-m / d``, for ``d*sc*q - dmin*m`` it is
``dmin*m / (d*sc)``: not integers. A group whose scale is 0 holds one constant value ``c``; it is
stored exactly as codes 0, scale ``c`` (or ``-c``) and zero -1 (or 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K as _GgufQ4K

QK_K = 256


@dataclass
class GroupCodes:
    """One tensor as ``w[r, k] = (codes[r, k] - zero[r, k // G]) * scale[r, k // G]``.

    Attributes:
        codes: ``[rows, K]`` uint8 (unsigned types) or int8 (symmetric types stored signed).
        scale: fp32 ``[rows, K // G]``.
        zero: fp32 ``[rows, K // G]``, or None when every zero is 0 (symmetric signed codes).
        group_size: G.
        bits: bits per code in the file (4, 5, 6 or 8).
    """

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    group_size: int
    bits: int


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """fp16 field at byte ``start`` of each block -> fp32 ``[rows, nblocks]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """``qs [..., 16]`` bytes -> ``[..., 32]``: element j is the low nibble of byte j, j + 16 the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """``qh [..., 4]`` bytes (a little-endian uint32) -> ``[..., 32]`` bit j of it."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _affine(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w = d * q + m`` per group -> ``(codes, scale, zero)`` with ``zero = -m / d``.

    A group with ``d == 0`` is the constant ``m``: codes 0, scale ``m``, zero -1 (``(0 + 1) * m``).
    ``codes`` ``[rows, groups, G]``; ``d``, ``m`` ``[rows, groups]``.
    """
    flat = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, np.float32(-1.0), -m / np.where(flat, np.float32(1.0), d)).astype(np.float32)
    scale = np.where(flat, m, d).astype(np.float32)
    if flat.any():
        codes = np.where(flat[..., None], np.uint8(0), codes)
    return codes, scale, zero


def _kquant_scale_min(blocks: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (sc, m) pairs of a Q4_K/Q5_K super-block: ``[rows, nblocks, 8]`` each.

    Unpacked by the ``gguf`` package's own ``Q4_K.get_scale_min`` (shared with Q5_K)."""
    rows, nb = blocks.shape[:2]
    sc, mn = _GgufQ4K.get_scale_min(np.ascontiguousarray(blocks[..., start:start + 12]).reshape(rows * nb, 12))
    return sc.reshape(rows, nb, 8).astype(np.float32), mn.reshape(rows, nb, 8).astype(np.float32)


def _split_k_quant(blocks: np.ndarray, q: np.ndarray, bits: int) -> GroupCodes:
    """Q4_K / Q5_K: ``w = d*sc*q - dmin*m`` per sub-block of 32 -> GroupCodes (zero ``dmin*m / (d*sc)``)."""
    rows, nb = blocks.shape[:2]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _kquant_scale_min(blocks, 4)
    codes, scale, zero = _affine(q.reshape(rows, nb * 8, 32), (d[..., None] * sc).reshape(rows, nb * 8),
                                 -(dmin[..., None] * mn).reshape(rows, nb * 8))
    return GroupCodes(codes.reshape(rows, -1), scale, zero, 32, bits)


def unpack_q4_0(blocks: np.ndarray) -> GroupCodes:
    rows, nb = blocks.shape[:2]  # nb: blocks per row
    codes = _nibbles_32(blocks[..., 2:18]).reshape(rows, -1)
    return GroupCodes(codes, _f16(blocks, 0), np.full((rows, nb), 8.0, dtype=np.float32), 32, 4)


def unpack_q4_1(blocks: np.ndarray) -> GroupCodes:
    rows = blocks.shape[0]
    codes, scale, zero = _affine(_nibbles_32(blocks[..., 4:20]), _f16(blocks, 0), _f16(blocks, 2))
    return GroupCodes(codes.reshape(rows, -1), scale, zero, 32, 4)


def unpack_q4_k(blocks: np.ndarray) -> GroupCodes:
    qs = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)  # chunk c: sub-block 2c low nibbles, 2c + 1 high
    return _split_k_quant(blocks, q, 4)


def unpack_q5_0(blocks: np.ndarray) -> GroupCodes:
    rows = blocks.shape[0]
    q = _nibbles_32(blocks[..., 6:22]) | (_high_bits_32(blocks[..., 2:6]) << 4)
    codes = (q.astype(np.int16) - 16).astype(np.int8).reshape(rows, -1)
    return GroupCodes(codes, _f16(blocks, 0), None, 32, 5)


def unpack_q5_1(blocks: np.ndarray) -> GroupCodes:
    rows = blocks.shape[0]
    q = _nibbles_32(blocks[..., 8:24]) | (_high_bits_32(blocks[..., 4:8]) << 4)
    codes, scale, zero = _affine(q, _f16(blocks, 0), _f16(blocks, 2))
    return GroupCodes(codes.reshape(rows, -1), scale, zero, 32, 5)


def unpack_q5_k(blocks: np.ndarray) -> GroupCodes:
    qh = blocks[..., 16:48].reshape(*blocks.shape[:2], 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # sub-block j: bit j of qh[l]
    qs = blocks[..., 48:176].reshape(*blocks.shape[:2], 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*blocks.shape[:2], 8, 32)
    return _split_k_quant(blocks, low | (high << 4), 5)


def unpack_q6_k(blocks: np.ndarray) -> GroupCodes:
    rows, nb = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, nb, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(rows, nb, 8, 32)
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3).reshape(rows, nb, 8, 32)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, nb, 16]
    scale = (_f16(blocks, 208)[..., None] * sc).reshape(rows, nb * 16)
    return GroupCodes(codes, scale, None, 16, 6)


def unpack_q8_0(blocks: np.ndarray) -> GroupCodes:
    rows = blocks.shape[0]
    codes = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(rows, -1)
    return GroupCodes(codes, _f16(blocks, 0), None, 32, 8)


# GGML type -> (unpacker, run-time kind). 4-bit codes run on the W4 kernels, the rest as int8 (W8).
UNPACKERS = {
    T.Q4_0: (unpack_q4_0, "w4"), T.Q4_1: (unpack_q4_1, "w4"), T.Q4_K: (unpack_q4_k, "w4"),
    T.Q5_0: (unpack_q5_0, "w8"), T.Q5_1: (unpack_q5_1, "w8"), T.Q5_K: (unpack_q5_k, "w8"),
    T.Q6_K: (unpack_q6_k, "w8"), T.Q8_0: (unpack_q8_0, "w8"),
}
DENSE_TYPES = (T.F32, T.F16, T.BF16)


def unpack_blocks(raw: np.ndarray, ggml_type: T, row_len: int) -> GroupCodes:
    """Raw bytes of a 2-D GGUF tensor -> :class:`GroupCodes`.

    Args:
        raw: uint8 ``[rows, row_bytes]`` (``GGUFReader`` tensor data, or the same bytes read from disk).
        ggml_type: one of :data:`UNPACKERS`.
        row_len: elements per row (K, GGUF ``ne0``).
    Raises:
        ValueError: a type without an unpacker, or bytes that do not match ``row_len``.
    """
    if ggml_type not in UNPACKERS:
        raise ValueError(f"no integer-code unpacker for GGUF type {ggml_type.name}")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if row_len % block_size or raw.shape[-1] != row_len // block_size * type_size:
        raise ValueError(f"{ggml_type.name}: {raw.shape[-1]} bytes per row do not hold {row_len} elements")
    blocks = raw.reshape(raw.shape[0], row_len // block_size, type_size)
    return UNPACKERS[ggml_type][0](blocks)
