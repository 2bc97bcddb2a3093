"""The CPU's 4-bit product with int8 activations (``cpu_native.w4a8_linear``, ``native/cpu_w4a8.c``) against
its reference twin (``reference.w4a8_gemm``), its dense path for many rows, and how ``cpu_lowbit`` picks it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightinfer.kernels import cpu_native, pack_int4_rows, prepare_w4_cpu, switches
from lightinfer.kernels import reference as ref
from lightinfer.kernels.cpu_lowbit import CpuQuantWeight, CpuW4A8Weight, quant_linear

needs_native = pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def _w4a8_on() -> Iterator[None]:
    """The C product is opt-in (``LIGHTINFER_CPU_W4A8=1``): on for every test here unless one says otherwise."""
    with switches.override(cpu_w4a8=True):
        yield


def _weight(n: int, k: int, g: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A W4 run-time weight (qweight int32 [N, K // 8], scales and integer zeros [K // G, N]) with fp16 scales,
    as AWQ and GGUF store them (so the C layout's fp16 scales are exact)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.002).half().float()
    zeros = torch.randint(0, 16, (k // g, n), generator=gen).float()
    return pack_int4_rows(codes), scales, zeros


def _c_dense(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 weight the C layout stands for: ``s q + m`` with the offsets ``m = -z s`` in fp16."""
    g = qweight.shape[1] * 8 // scales.shape[0]
    q = ref.unpack_int4_rows(qweight).float()
    m = (-zeros * scales).half().float().t().repeat_interleave(g, dim=1)
    return q * scales.t().repeat_interleave(g, dim=1) + m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_native
@pytest.mark.parametrize(("n", "k", "g"), [(96, 576, 32), (64, 1536, 64), (48, 256, 128), (32, 96, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_the_c_product_is_its_reference_twin(n: int, k: int, g: int, rows: int) -> None:
    """Every row count of a tile and its remainder, K with and without blocks after the last 8-block group
    (576 = 2 x 256 + 64; 96 has none of 256), groups of 32 to 128: the kernel's only differences from the
    twin are fp32 summation order and the offsets d * z rounded to fp16."""
    qweight, scales, zeros = _weight(n, k, g)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    assert isinstance(prepared, CpuW4A8Weight)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    want = ref.w4a8_gemm(x, qweight, scales, zeros, bias)
    assert _rel(quant_linear(x, prepared, bias), want) < 2e-4
    got_bf16 = quant_linear(x.bfloat16(), prepared, bias)
    assert got_bf16.dtype == torch.bfloat16
    assert _rel(got_bf16, ref.w4a8_gemm(x.bfloat16(), qweight, scales, zeros, bias)) < 8e-3  # bf16 output rounding


@needs_native
def test_int8_activations_cost_little_against_the_exact_product() -> None:
    """The quantization of x is what separates the C product from the 16-bit one: about 1% of the output's
    norm on random data (a model's held-out perplexity moves far less: docs/cpu_performance.md)."""
    qweight, scales, zeros = _weight(256, 1536, 32)
    x = torch.randn(4, 1536)
    exact = ref.w4a16_gemm(x, qweight, scales, zeros)
    err = _rel(quant_linear(x, prepare_w4_cpu(qweight, scales, zeros)), exact)
    assert 1e-4 < err < 2e-2


@needs_native
def test_many_rows_take_the_dense_path_exactly() -> None:
    """From W4_DENSE_ROWS rows the weight is dequantized and x is not quantized: the fp32 product with the
    weight the layout holds, in slices of rows when the layer is larger than the buffer."""
    qweight, scales, zeros = _weight(208, 576, 64)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    x = torch.randn(cpu_native.W4_DENSE_ROWS + 5, 576)
    want = x @ _c_dense(qweight, scales, zeros).t()
    assert _rel(quant_linear(x, prepared), want) < 1e-5
    small = cpu_native.W4_DENSE_FLOATS
    try:
        cpu_native.W4_DENSE_FLOATS = 576 * 48  # 48 rows at a time: 5 slices
        assert _rel(quant_linear(x, prepared), want) < 1e-5
    finally:
        cpu_native.W4_DENSE_FLOATS = small


@needs_native
def test_act_order_and_3d_inputs() -> None:
    qweight, scales, zeros = _weight(64, 256, 32)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    prepared = prepare_w4_cpu(qweight, scales, zeros, input_perm=perm)
    x = torch.randn(2, 3, 256)
    want = ref.w4a8_gemm(x[..., perm].reshape(6, 256), qweight, scales, zeros).reshape(2, 3, 64)
    got = quant_linear(x, prepared)
    assert got.shape == (2, 3, 64) and _rel(got, want) < 2e-4


def test_the_switch_and_odd_scales_keep_torchs_int4_gemm() -> None:
    """The default (``LIGHTINFER_CPU_W4A8`` unset or 0), and any machine without the C library, keeps torch's
    layout with bf16 activations; so do scales that fp16 would not hold (below its normal range)."""
    qweight, scales, zeros = _weight(64, 256, 32)
    with switches.override(cpu_w4a8=False):
        assert isinstance(prepare_w4_cpu(qweight, scales, zeros), CpuQuantWeight)
    with switches.override(cpu_native=False):
        assert isinstance(prepare_w4_cpu(qweight, scales, zeros), CpuQuantWeight)
    if cpu_native.library() is not None:
        assert isinstance(prepare_w4_cpu(qweight, scales, zeros), CpuW4A8Weight)
        tiny = scales.clone()
        tiny[0, 0] = 1e-6
        assert isinstance(prepare_w4_cpu(qweight, tiny, zeros), CpuQuantWeight)


@needs_native
def test_the_c_layout_keeps_the_memory_of_torchs() -> None:
    qweight, scales, zeros = _weight(256, 576, 32)
    c = prepare_w4_cpu(qweight, scales, zeros)
    with switches.override(cpu_w4a8=False):
        t = prepare_w4_cpu(qweight, scales, zeros)
    assert c.nbytes <= t.nbytes
