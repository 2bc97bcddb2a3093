"""The CPU low-bit GEMM on torch's kernels (kernels/cpu_lowbit.py with ``LIGHTINFER_CPU_W4=torch``, and its W8
paths) against its reference twins (reference.w4a16_gemm / w8a16_gemm). The default W4 path, the C product, is
held to its own twin in test_cpu_w4.py, and its int8-activation form in test_cpu_w4a8.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightinfer.kernels import cpu_quant_linear, pack_int4_rows, prepare_w4_cpu, prepare_w8_cpu, switches
from lightinfer.kernels import reference as ref
from lightinfer.kernels.cpu_lowbit import int4_gemm_available

pytestmark = pytest.mark.skipif(not int4_gemm_available(), reason="this torch has no CPU int4 GEMM")


@pytest.fixture(autouse=True)
def _torchs_int4_gemm() -> Iterator[None]:
    with switches.override(cpu_w4="torch"):
        yield


def _w4(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A W4 run-time weight with fractional zeros (as GGUF Q4_1 gives): qweight, scales, zeros."""
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    zeros = torch.rand(k // group, n, generator=gen) * 15
    return pack_int4_rows(codes), scales, zeros


def _rel_err(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("group", [32, 64, 128, 192])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_w4_matches_the_reference_twin(group: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(group + rows)
    n, k = 48, 384
    qweight, scales, zeros = _w4(n, k, group, gen)
    bias = torch.randn(n, generator=gen)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    assert prepared is not None and prepared.group_size == (64 if group == 192 else group)  # 192: as 3 x 64
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        y = cpu_quant_linear(x, prepared, bias.to(dtype))
        want = ref.w4a16_gemm(x.float(), qweight, scales, zeros, bias)
        assert y.dtype == dtype and y.shape == (rows, n)
        assert _rel_err(y, want) < 1e-2  # bf16 activations, scales and offsets: ~3 significant digits


def test_w4_act_order_input_permutation() -> None:
    gen = torch.Generator().manual_seed(1)
    n, k = 32, 128
    qweight, scales, zeros = _w4(n, k, 32, gen)
    perm = torch.randperm(k, generator=gen)
    prepared = prepare_w4_cpu(qweight, scales, zeros, perm)
    x = torch.randn(3, k, generator=gen)
    want = ref.w4a16_gemm(x[:, perm], qweight, scales, zeros)  # the stored K order is x[..., perm]
    assert _rel_err(cpu_quant_linear(x, prepared), want) < 1e-2


def test_w4_is_exact_where_bf16_is() -> None:
    """Integer zeros, power-of-two scales, a one-hot input: every product is representable, so the kernel's
    result is the dequantized weight itself, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    n, k = 64, 64
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.full((2, n), 0.25)
    zeros = torch.randint(0, 16, (2, n), generator=gen).float()
    qweight = pack_int4_rows(codes)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    got = cpu_quant_linear(torch.eye(k), prepared)  # row i = column i of W^T = W[:, i]
    assert torch.equal(got, ref.dequantize_w4(qweight, scales, zeros).t())


@pytest.mark.parametrize("symmetric", [True, False])
def test_w8_two_nibble_halves_are_exact(symmetric: bool) -> None:
    """int8 codes split into two int4 halves lose nothing: with a one-hot input the result is the weight."""
    gen = torch.Generator().manual_seed(3)
    n, k = 80, 64  # 80: not a multiple of 64, the halves are packed together
    q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.full((k // 32, n), 0.5)
    zeros = None if symmetric else torch.randint(-3, 4, (k // 32, n), generator=gen).float()
    prepared = prepare_w8_cpu(q, scales, zeros)
    assert prepared is not None and prepared.num_splits == 2
    assert torch.equal(cpu_quant_linear(torch.eye(k), prepared), ref.dequantize_w8(q, scales, zeros).t())


@pytest.mark.parametrize("n", [64, 8256])  # 8256: several chunks of rows at load
def test_w8_matches_the_reference_twin(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    k = 96
    q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(k // 32, n, generator=gen) * 0.01
    x = torch.randn(4, k, generator=gen)
    prepared = prepare_w8_cpu(q, scales, None)
    assert _rel_err(cpu_quant_linear(x, prepared), ref.w8a16_gemm(x, q, scales, None)) < 1e-2


def test_shapes_the_kernel_cannot_take_give_none() -> None:
    gen = torch.Generator().manual_seed(4)
    qweight, scales, zeros = _w4(40, 64, 32, gen)  # N = 40: torch's kernel needs a multiple of 16
    assert prepare_w4_cpu(qweight, scales, zeros) is None
    q = torch.zeros(32, 64, dtype=torch.int8)
    assert prepare_w8_cpu(q, torch.ones(4, 32), None) is None  # groups of 16 (Q6_K): no kernel group divides them
    assert prepare_w8_cpu(q, torch.ones(2, 32), None) is not None


def test_prepared_weight_is_smaller_than_the_run_time_layout() -> None:
    gen = torch.Generator().manual_seed(5)
    qweight, scales, zeros = _w4(256, 512, 32, gen)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    runtime = qweight.numel() * 4 + 2 * scales.numel() * 4  # int32 codes + fp32 scales and zeros
    assert prepared.nbytes <= runtime
    assert prepared.nbytes == 256 * 512 // 2 + (512 // 32) * 256 * 2 * 2  # half a byte a weight + bf16 pairs
