"""The CPU's C 8-bit product for a weight with one scale per row (``cpu_native.w8_linear``, ``native/cpu_w8.c``:
an 8-bit LM head through ``cpu_lowbit.int8_linear``) against its reference twin (``reference.w8_rows_gemm``), the
exact product and torch's ``_weight_int8pack_mm``, which ``LIGHTINFER_CPU_W4=torch`` keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightinfer.kernels import cpu_native
from lightinfer.kernels import reference as ref
from lightinfer.kernels.cpu_lowbit import CpuInt8Weight, int8_linear, int8pack_available
from tests.kernels.test_cpu_w4 import rel_err

needs_native = pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler on this machine")


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return q, (torch.rand(n, generator=gen) * 0.01 + 1e-3).bfloat16()


@needs_native
@pytest.mark.parametrize(("n", "k"), [(64, 576), (37, 96), (16, 4096), (5, 2080)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13])
def test_the_c_product_is_its_reference_twin(n: int, k: int, rows: int) -> None:
    """Every row count of a tile and its remainder; K = 4096 crosses the 2,048 values summed per int32 lane
    before a conversion, and 2080 leaves 32 after the last 4-vector step."""
    q, s = _weight(n, k, seed=k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 4
    bias = torch.randn(n)
    got = cpu_native.w8_linear(x, q, s, bias, torch.float32)
    assert got is not None and got.shape == (rows, n)
    assert rel_err(got, ref.w8_rows_gemm(x, q, s, bias)) < 1e-6
    got_bf16 = cpu_native.w8_linear(x.bfloat16(), q, s, None, torch.bfloat16)
    assert got_bf16.dtype == torch.bfloat16
    assert rel_err(got_bf16, ref.w8_rows_gemm(x.bfloat16().float(), q, s)) < 4e-3  # output rounding


@needs_native
def test_int16_rows_are_all_but_exact_and_closer_than_torchs_bf16() -> None:
    q, s = _weight(512, 576)
    x = torch.randn(4, 576)
    exact = x @ (q.float() * s.float()[:, None]).t()
    weight = CpuInt8Weight(512, 576, q, s)
    c = rel_err(int8_linear(x, weight), exact)
    assert c < 1e-4, c
    if int8pack_available():
        torch_err = rel_err(int8_linear(x, dataclasses.replace(weight, torch_product=True)), exact)
        assert c < torch_err, (c, torch_err)


@needs_native
def test_the_int8_linear_takes_act_order_3d_and_a_bias() -> None:
    q, s = _weight(48, 256)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    weight = CpuInt8Weight(48, 256, q, s, input_perm=perm)
    x = torch.randn(2, 3, 256)
    bias = torch.randn(48).bfloat16()
    got = int8_linear(x, weight, bias)
    want = ref.w8_rows_gemm(x[..., perm].reshape(6, 256), q, s, bias.float()).reshape(2, 3, 48)
    assert got.shape == (2, 3, 48) and got.dtype == torch.float32 and rel_err(got, want) < 1e-6


@needs_native
def test_what_the_c_product_does_not_take_returns_none() -> None:
    q, s = _weight(8, 48)  # K not a multiple of 32
    assert cpu_native.w8_linear(torch.randn(1, 48), q, s, None, torch.float32) is None
    q, s = _weight(8, 64)
    assert cpu_native.w8_linear(torch.randn(1, 64).half(), q, s, None, torch.float32) is None
    assert cpu_native.w8_linear(torch.randn(1, 64), q, s.float(), None, torch.float32) is None
    assert cpu_native.w8_linear(torch.randn(1, 32), q, s, None, torch.float32) is None  # K differs
