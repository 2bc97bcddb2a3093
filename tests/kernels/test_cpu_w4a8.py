"""The CPU's 4-bit product with int8 activations (``cpu_native.w4_linear(..., int8_activations=True)``,
``native/cpu_w4a8.c``, ``LIGHTINFER_CPU_W4=int8``) against its reference twin (``reference.w4_act_gemm(..., bits=8)``), its
dense path for many rows, and how ``cpu_lowbit`` picks it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightinfer.kernels import cpu_native, prepare_w4_cpu, switches
from lightinfer.kernels import reference as ref
from lightinfer.kernels.cpu_lowbit import CpuW4Weight, quant_linear
from tests.kernels.test_cpu_w4 import rel_err, w4_weight

needs_native = pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def _w4a8_on() -> Iterator[None]:
    """int8 activations are opt-in (``LIGHTINFER_CPU_W4=int8``): on for every test here unless one says otherwise."""
    with switches.override(cpu_w4="int8"):
        yield


@needs_native
@pytest.mark.parametrize(("n", "k", "g"), [(96, 576, 32), (64, 1536, 64), (48, 256, 128), (32, 96, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_the_c_product_is_its_reference_twin(n: int, k: int, g: int, rows: int) -> None:
    """Every row count of a tile and its remainder, K with and without blocks after the last 8-block group
    (576 = 2 x 256 + 64; 96 has none of 256), groups of 32 to 128: the kernel's only differences from the
    twin are fp32 summation order and the offsets d * z rounded to fp16."""
    qweight, scales, zeros = w4_weight(n, k, g)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    assert isinstance(prepared, CpuW4Weight) and prepared.int8_activations
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    want = ref.w4_act_gemm(x, qweight, scales, zeros, bias, bits=8)
    assert rel_err(quant_linear(x, prepared, bias), want) < 2e-4
    got_bf16 = quant_linear(x.bfloat16(), prepared, bias)
    assert got_bf16.dtype == torch.bfloat16
    assert rel_err(got_bf16, ref.w4_act_gemm(x.bfloat16(), qweight, scales, zeros, bias, bits=8)) < 8e-3  # bf16 output rounding


@needs_native
def test_int8_activations_cost_little_against_the_exact_product() -> None:
    """The quantization of x is what separates the C product from the 16-bit one: about 1% of the output's
    norm on random data (a model's held-out perplexity moves far less: docs/cpu_performance.md)."""
    qweight, scales, zeros = w4_weight(256, 1536, 32)
    x = torch.randn(4, 1536)
    exact = ref.w4a16_gemm(x, qweight, scales, zeros)
    err = rel_err(quant_linear(x, prepare_w4_cpu(qweight, scales, zeros)), exact)
    assert 1e-4 < err < 2e-2


@needs_native
def test_act_order_and_3d_inputs() -> None:
    qweight, scales, zeros = w4_weight(64, 256, 32)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    prepared = prepare_w4_cpu(qweight, scales, zeros, input_perm=perm)
    x = torch.randn(2, 3, 256)
    want = ref.w4_act_gemm(x[..., perm].reshape(6, 256), qweight, scales, zeros, bits=8).reshape(2, 3, 64)
    got = quant_linear(x, prepared)
    assert got.shape == (2, 3, 64) and rel_err(got, want) < 2e-4
