"""W8A16 GEMM (``kernels/w8a16_gemm.py``) against its twin ``reference.w8a16_gemm`` under TRITON_INTERPRET=1,
and its configurations against a consumer card's shared memory (sm_86, compiled without a GPU)."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import reference as ref
from lightinfer.kernels.w8a16_gemm import w8a16_gemm

TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 1e-2},
       torch.bfloat16: {"atol": 1e-1, "rtol": 3e-2}}


def _weights(n: int, k: int, g: int, with_zeros: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(k // g, n, generator=gen) * 0.01 + 0.001
    zeros = torch.rand(k // g, n, generator=gen) * 20 - 10 if with_zeros else None  # fractional, as GGUF Q5_1
    return q, scales, zeros


@pytest.mark.parametrize("m,n,k,g", [(1, 40, 96, 32), (20, 72, 80, 16), (70, 24, 64, 64), (3, 8, 192, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_zeros", [False, True])
def test_matches_reference(m: int, n: int, k: int, g: int, dtype: torch.dtype, with_zeros: bool) -> None:
    q, s, z = _weights(n, k, g, with_zeros)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
    got = w8a16_gemm(x, q, s, z, bias)
    want = ref.w8a16_gemm(x, q, s, z, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_dequantize_w8_definition() -> None:
    q, s, z = _weights(16, 64, 32, True)
    w = ref.dequantize_w8(q, s, z)
    n, k = 5, 40
    assert torch.allclose(w[n, k], (q[n, k].float() - z[k // 32, n]) * s[k // 32, n])
    assert torch.equal(ref.dequantize_w8(q, s, None)[n, k], q[n, k].float() * s[k // 32, n])


@pytest.mark.parametrize("bad", ["qweight_dtype", "scales_dtype", "group", "zeros_shape", "x_dim"])
def test_bad_inputs_are_clear(bad: str) -> None:
    q, s, z = _weights(16, 64, 32, True)
    x = torch.randn(2, 64)
    if bad == "qweight_dtype":
        q = q.to(torch.int32)
    elif bad == "scales_dtype":
        s = s.half()
    elif bad == "group":
        s = torch.rand(3, 16)
    elif bad == "zeros_shape":
        z = z[:1]
    else:
        x = x[0]
    with pytest.raises(ValueError, match="w8a16_gemm"):
        w8a16_gemm(x, q, s, z)

