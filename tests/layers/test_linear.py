"""``W4A16Linear.integer_zeros``: worked out at load, ANDed by projection fusion, passed to the GEMM."""

from __future__ import annotations

import os

import pytest
import torch

from lightinfer.kernels import get_backend, pack_awq
from lightinfer.layers.linear import W4A16Linear, fuse_linears
from lightinfer.layers.ops import triton_on_cpu


def _runtime(k: int, n: int, gen: torch.Generator, zeros: torch.Tensor) -> W4A16Linear:
    layer = W4A16Linear(k, n, False, 32, torch.float32)
    qweight = torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=gen, dtype=torch.int64).to(torch.int32)
    layer.load_runtime(qweight, torch.rand(layer.scales.shape, generator=gen) * 0.01, zeros)
    return layer


def test_load_methods_work_out_whether_zeros_are_integers() -> None:
    gen = torch.Generator().manual_seed(0)
    assert W4A16Linear(64, 16, False, 32, torch.float32).integer_zeros is False  # nothing loaded: exact decode
    assert _runtime(64, 16, gen, torch.full((2, 16), 8.0)).integer_zeros is True  # GPTQ, compressed-tensors, Q4_0
    fractional = torch.full((2, 16), 8.0)
    fractional[1, 3] = 7.25  # one GGUF Q4_1 zero -m/d is enough
    assert _runtime(64, 16, gen, fractional).integer_zeros is False
    awq = W4A16Linear(64, 16, False, 32, torch.float16)
    awq.integer_zeros = False
    codes = torch.randint(0, 16, (64, 16), generator=gen, dtype=torch.int32)
    awq.load_awq(pack_awq(codes), pack_awq(torch.randint(0, 16, (2, 16), generator=gen, dtype=torch.int32)),
                 torch.rand(2, 16, generator=gen).half())
    assert awq.integer_zeros is True
    # What counts is the zero as stored: 8.0001 is 8 in fp16, which the pair decode subtracts exactly.
    half = W4A16Linear(64, 16, False, 32, torch.float16)
    half.load_runtime(torch.zeros(16, 8, dtype=torch.int32), torch.ones(2, 16), torch.full((2, 16), 8.0001))
    assert half.integer_zeros is True


def test_fused_projections_have_integer_zeros_only_if_every_part_has() -> None:
    """A GGUF file may mix Q4_0 (zero 8) and Q4_K (fractional) projections of one input: fused, one GEMM
    serves all of them, so one fractional part takes the whole GEMM to the exact decode."""
    gen = torch.Generator().manual_seed(1)
    q4_0 = [_runtime(64, 16, gen, torch.full((2, 16), 8.0)) for _ in range(2)]
    q4_k = _runtime(64, 8, gen, torch.rand(2, 8, generator=gen) * 15)
    assert fuse_linears(q4_0).integer_zeros is True
    mixed = fuse_linears([*q4_0, q4_k])
    assert mixed is not None and mixed.integer_zeros is False
    assert torch.equal(mixed.zeros, torch.cat([m.zeros for m in (*q4_0, q4_k)], dim=1))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("fractional", [False, True])
def test_forward_passes_the_flag_to_the_gemm(monkeypatch: pytest.MonkeyPatch, fractional: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    zeros = torch.rand(2, 16, generator=gen) * 15 if fractional else torch.randint(0, 16, (2, 16), generator=gen).float()
    layer = _runtime(64, 16, gen, zeros)
    assert layer.integer_zeros is not fractional
    triton_ops, seen = get_backend("triton"), []
    gemm = triton_ops.w4a16_gemm

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(kwargs.get("integer_zeros"))
        return gemm(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "w4a16_gemm", recording)
    x = torch.randn(3, 64, generator=gen)
    with triton_on_cpu():
        y = layer(x)
    assert seen == [not fractional]
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.dense_weight()), atol=1e-4, rtol=1e-4)
