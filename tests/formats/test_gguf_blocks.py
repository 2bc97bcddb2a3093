"""GGUF block unpacking (``formats/gguf_blocks.py``) against the ``gguf`` package's own dequantizer."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from lightinfer.formats.gguf_blocks import unpack_blocks
from tests.formats.gguf_files import random_blocks

QUANTIZERS = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # the gguf package quantizes these
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)  # gguf only dequantizes these: random (valid) blocks


def _raw(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if ggml_type in K_QUANTS:
        return random_blocks(ggml_type, rows, cols, rng)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[:, :5] += 0.3  # groups not centred on zero: Q4_1 / Q5_1 minimums away from 0
    return quantize(w, ggml_type)


def _dense(gc) -> np.ndarray:  # type: ignore[no-untyped-def]
    g = gc.group_size
    scale = np.repeat(gc.scale, g, axis=1)
    zero = 0.0 if gc.zero is None else np.repeat(gc.zero, g, axis=1)
    return (gc.codes.astype(np.float32) - zero) * scale


@pytest.mark.parametrize("ggml_type", QUANTIZERS + K_QUANTS)
def test_codes_scale_zero_reproduce_gguf_dequantize(ggml_type: T) -> None:
    cols = 512
    raw = _raw(ggml_type, 6, cols)
    gc = unpack_blocks(raw, ggml_type, cols)
    want = dequantize(raw, ggml_type)
    assert gc.codes.shape == (6, cols) and gc.scale.shape == (6, cols // gc.group_size)
    np.testing.assert_allclose(_dense(gc), want, rtol=1e-5, atol=1e-7 * np.abs(want).max())
    assert gc.codes.min() >= (-128 if gc.codes.dtype == np.int8 else 0)
    if gc.bits == 4:
        assert gc.codes.dtype == np.uint8 and gc.codes.max() <= 15


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q4_K, T.Q5_K])
def test_group_with_zero_scale_is_its_constant(ggml_type: T) -> None:
    """A group whose scale is 0 holds one value: it is stored as codes 0 with the value as the scale."""
    cols = 256
    raw = _raw(ggml_type, 2, cols, seed=3).copy().reshape(2, -1)
    if ggml_type == T.Q4_1:
        raw.reshape(2, -1, 20)[0, 1, 0:2] = 0  # d = 0 in the second block of row 0
    else:
        size = {T.Q4_K: 144, T.Q5_K: 176}[ggml_type]
        raw.reshape(2, -1, size)[0, 0, 4] &= 0xC0  # sc of sub-block 0 = 0 (low 6 bits of scales[0])
    gc = unpack_blocks(raw, ggml_type, cols)
    np.testing.assert_allclose(_dense(gc), dequantize(raw, ggml_type), rtol=1e-5, atol=1e-7)
    g = 1 if ggml_type == T.Q4_1 else 0
    assert np.all(gc.codes[0, g * 32:(g + 1) * 32] == 0)


def test_row_length_mismatch_is_an_error() -> None:
    raw = _raw(T.Q4_0, 2, 64)
    with pytest.raises(ValueError, match="Q4_0"):
        unpack_blocks(raw, T.Q4_0, 96)
