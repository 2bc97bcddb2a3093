"""The fp16 pair decode's PTX (``w4_decode.F16_PAIR_DECODE_PTX``), run instruction by instruction in Python.

The CPU interpreter cannot run inline PTX, so the kernels use a plain-Triton twin there; this test holds the
PTX itself to the run-time layout (nibble i of a word = k = 8 j + i) for every code at every nibble position,
sign bit included. The semantics modelled are the PTX ISA's (``shl``, ``shr.u32``, ``prmt`` default mode,
``lop3`` truth tables, ``mov.b32 {lo, hi}``); tests/gpu runs the kernels themselves on a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from lightinfer.kernels.w4_decode import F16_PAIR_DECODE_PTX

MASK32 = 0xFFFFFFFF


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """``prmt.b32 d, a, b, sel`` (default mode): byte i of d is byte ``sel[4i:4i+3] & 7`` of {b, a} (a = 0..3),
    replicated sign when bit 3 of the selector nibble is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(a.dtype)
        out |= byte << (8 * i)
    return out


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """``lop3.b32 d, a, b, c, lut``: each bit of d is bit ``4a + 2b + c`` of ``lut``."""
    out = np.zeros_like(a)
    for idx in range(8):
        if lut >> idx & 1:
            sel_a = a if idx & 4 else ~a & MASK32
            sel_b = b if idx & 2 else ~b & MASK32
            sel_c = c if idx & 1 else ~c & MASK32
            out |= sel_a & sel_b & sel_c
    return out


def run_ptx(text: str, words: np.ndarray) -> list[np.ndarray]:
    """Run the decode program on ``words`` (the ``$8`` input); returns the eight 16-bit outputs ``$0..$7``."""
    regs: dict[str, np.ndarray] = {"$8": words.astype(np.int64) & MASK32}

    def val(tok: str) -> np.ndarray | int:
        tok = tok.strip()
        return int(tok, 0) if re.match(r"^(0x[0-9a-fA-F]+|\d+)$", tok) else regs[tok]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":
            m = re.match(r"\{(\S+),\s*(\S+)\},\s*(\S+)", rest)
            assert m, line
            regs[m.group(1)] = val(m.group(3)) & 0xFFFF
            regs[m.group(2)] = val(m.group(3)) >> 16 & 0xFFFF
            continue
        dst, *args = [t.strip() for t in rest.split(",")]
        if op == "shl.b32":
            regs[dst] = (val(args[0]) << val(args[1])) & MASK32
        elif op == "shr.u32":
            regs[dst] = val(args[0]) >> val(args[1])
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(args[0]), val(args[1]), val(args[2]))
        elif op == "lop3.b32":
            a, b, c = (np.broadcast_to(np.asarray(val(t), dtype=np.int64), words.shape) for t in args[:3])
            regs[dst] = _lop3(a, b, c, val(args[3]))
        else:
            raise AssertionError(f"the model does not know {op!r}: add it here")
    return [regs[f"${i}"] for i in range(8)]


def _words() -> tuple[np.ndarray, np.ndarray]:
    """Words with every code at every nibble position (codes[w, i] = nibble i of word w), then random ones."""
    rng = np.random.default_rng(0)
    codes = np.concatenate([(np.arange(16)[:, None] + np.arange(8)[None, :] * 3) % 16,
                            rng.integers(0, 16, size=(4096, 8))])
    words = (codes << (4 * np.arange(8))[None, :]).sum(axis=1)
    return np.where(words >= 2**31, words - 2**32, words).astype(np.int32), codes  # int32, as the kernels load them


def test_ptx_decodes_every_nibble_to_fp16_1024_plus_code() -> None:
    words, codes = _words()
    assert (words < 0).any()  # sign bit set: shr.u32 must not drag it into nibble 7's neighbours
    outs = run_ptx(F16_PAIR_DECODE_PTX.value, words)
    for i, raw in enumerate(outs):
        got = raw.astype(np.uint16).view(np.float16).astype(np.float32)
        np.testing.assert_array_equal(got, 1024.0 + codes[:, i], err_msg=f"nibble {i}")  # 1024 + z is subtracted


@pytest.mark.parametrize("lut,expr", [(0xEA, lambda a, b, c: (a & b) | c), (0x96, lambda a, b, c: a ^ b ^ c)])
def test_the_models_of_lop3_and_prmt(lut: int, expr: object) -> None:
    """The instruction models against their definitions (PTX ISA examples)."""
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 2**32, size=64, dtype=np.int64) for _ in range(3))
    assert np.array_equal(_lop3(a, b, c, lut), expr(a, b, c))  # type: ignore[operator]
    x, y = np.array([0x44332211]), np.array([0x88776655])
    assert _prmt(x, y, 0x7610)[0] == 0x88772211 and _prmt(x, y, 0x7632)[0] == 0x88774433
    assert _prmt(x, y, 0x0008)[0] == 0x11111100  # selector nibble 8: byte 0 replaced by its sign (0x11: 0)
