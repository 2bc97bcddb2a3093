"""The CPU's default 4-bit product (``cpu_native.w4_linear``, ``native/cpu_w4a16.c``, ``LIGHTINFER_CPU_W4=c``)
against its reference twin (``reference.w4_dm16_gemm``): every tile shape of the kernel, its dense path for many
rows (torch's GEMM; the AMX product of a CPU that has it is ``test_cpu_w4_amx.py``'s), and how ``cpu_lowbit``
picks it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightinfer.kernels import cpu_native, pack_int4_rows, prepare_w4_cpu, switches
from lightinfer.kernels import reference as ref
from lightinfer.kernels.cpu_lowbit import CpuQuantWeight, CpuW4Weight, quant_linear

needs_native = pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def _c_product() -> Iterator[None]:
    """The default, set explicitly: a ``LIGHTINFER_CPU_W4`` in the environment does not change these tests; the
    AMX product off, so that a CPU with AMX tests the block products and torch's dense path too."""
    with switches.override(cpu_w4="c", cpu_native=True, cpu_amx=False):
        yield


def w4_weight(n: int, k: int, g: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A W4 run-time weight (qweight int32 [N, K // 8], scales and integer zeros [K // G, N]) with fp16 scales,
    as AWQ and GGUF store them."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.002).half().float()
    zeros = torch.randint(0, 16, (k // g, n), generator=gen).float()
    return pack_int4_rows(codes), scales, zeros


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_native
@pytest.mark.parametrize(("n", "k", "g"), [(96, 576, 32), (64, 1536, 64), (48, 256, 128), (32, 96, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
def test_the_c_product_is_its_reference_twin(n: int, k: int, g: int, rows: int) -> None:
    """Every row count of a tile and its remainder, K with and without blocks after the last 8-block group
    (576 = 2 x 256 + 64; 96 has none of 256), groups of 32 to 128, fp32 and bf16 inputs and outputs: the twin up
    to fp32 summation order."""
    qweight, scales, zeros = w4_weight(n, k, g)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    assert isinstance(prepared, CpuW4Weight) and not prepared.int8_activations
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    assert rel_err(quant_linear(x, prepared, bias), ref.w4_act_gemm(x, qweight, scales, zeros, bias)) < 1e-6
    xb = x.bfloat16()
    got = quant_linear(xb, prepared, bias, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert rel_err(got, ref.w4_act_gemm(xb.float(), qweight, scales, zeros, bias)) < 1e-6
    got_bf16 = quant_linear(xb, prepared, bias)
    assert got_bf16.dtype == torch.bfloat16
    assert rel_err(got_bf16, ref.w4_act_gemm(xb.float(), qweight, scales, zeros, bias)) < 4e-3  # output rounding


@needs_native
@pytest.mark.parametrize("n", [1, 6, 22, 37])
def test_output_counts_that_are_not_a_whole_tile(n: int) -> None:
    """``cpu_native.w4_linear`` takes any N, though the engine's layers have multiples of 16: output tiles of
    fewer than 4 rows and chunks of fewer than 16."""
    qweight, scales, zeros = w4_weight(n, 320, 32, seed=n)
    codes = ref.unpack_int4_rows(qweight).to(torch.uint8)
    packed = cpu_native.w4_pack(codes)
    s = scales.t()
    dm = torch.stack([s, -zeros.t() * s], dim=1).half().contiguous()
    w = ref.dequantize_w4_dm16(qweight, scales, zeros)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
        got = cpu_native.w4_linear(x, packed, dm, 32, None, torch.float32)
        assert got is not None and got.shape == (rows, n)
        # against the size of the products summed (a single output may cancel to near zero)
        scale = float((x.abs() @ w.abs().t()).norm())
        assert float((got - ref.w4_act_gemm(x, qweight, scales, zeros)).norm()) < 1e-6 * scale


@needs_native
def test_int16_activations_are_all_but_exact() -> None:
    """15 bits per block of 32 hold a bf16 activation exactly unless it is 2^7 times smaller than its block's
    largest: against the fp32 product with the weight the layout holds, ~1e-5 of the output's norm."""
    qweight, scales, zeros = w4_weight(256, 1536, 32)
    x = torch.randn(4, 1536)
    exact = x @ ref.dequantize_w4_dm16(qweight, scales, zeros).t()
    err = rel_err(quant_linear(x, prepare_w4_cpu(qweight, scales, zeros)), exact)
    assert err < 5e-5, err
    xb = torch.randn(4, 1536).bfloat16()
    assert rel_err(quant_linear(xb, prepare_w4_cpu(qweight, scales, zeros), out_dtype=torch.float32),
                xb.float() @ ref.dequantize_w4_dm16(qweight, scales, zeros).t()) < 5e-5


@needs_native
def test_more_exact_than_torchs_int4_gemm() -> None:
    """int16 activations and fp16 (d, m): closer to the fp32 product with the dequantized weight than torch's
    int4 GEMM, which rounds x and its (scale, offset) pairs to bf16 (measured 3e-4 against 2.7e-3 here; what is
    left is the offsets' fp16 rounding)."""
    qweight, scales, zeros = w4_weight(256, 1536, 32)
    x = torch.randn(4, 1536)
    exact = ref.w4a16_gemm(x, qweight, scales, zeros)
    c = rel_err(quant_linear(x, prepare_w4_cpu(qweight, scales, zeros)), exact)
    with switches.override(cpu_w4="torch"):
        torch_err = rel_err(quant_linear(x, prepare_w4_cpu(qweight, scales, zeros)), exact)
    assert c < torch_err / 4, (c, torch_err)


@needs_native
def test_many_rows_take_the_dense_path_exactly() -> None:
    """From W4_DENSE_ROWS rows the weight is dequantized into a buffer and torch's fp32 GEMM multiplies, in
    slices of rows when the layer is larger than the buffer."""
    qweight, scales, zeros = w4_weight(208, 576, 64)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    x = torch.randn(cpu_native.W4_DENSE_ROWS + 5, 576)
    want = x @ ref.dequantize_w4_dm16(qweight, scales, zeros).t()
    assert rel_err(quant_linear(x, prepared), want) < 1e-5
    small = cpu_native.W4_DENSE_FLOATS
    try:
        cpu_native.W4_DENSE_FLOATS = 576 * 48  # 48 rows at a time: 5 slices
        assert rel_err(quant_linear(x, prepared), want) < 1e-5
    finally:
        cpu_native.W4_DENSE_FLOATS = small


@needs_native
@pytest.mark.parametrize(("n", "k", "g"), [(48, 576, 64), (32, 1536, 32), (16, 96, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_weight_is_the_twins_bit_for_bit(n: int, k: int, g: int, dtype: torch.dtype) -> None:
    """li_w4_dequant (vectorised over super-blocks, plain blocks after them) writes d * q + m rounded once to
    the buffer's dtype: K with and without trailing blocks."""
    qweight, scales, zeros = w4_weight(n, k, g, seed=n)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    out = torch.empty(n, k, dtype=dtype)
    cpu_native.library().li_w4_dequant(prepared.packed.data_ptr(), prepared.dm.data_ptr(), prepared.group_size, n,
                                       k, out.data_ptr(), 1 if dtype == torch.bfloat16 else 0, 1)
    want = ref.dequantize_w4_dm16(qweight, scales, zeros).float()
    assert torch.equal(out, want.to(dtype))


@needs_native
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_prefill_takes_the_bf16_gemm_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch,
                                                                  out_dtype: torch.dtype) -> None:
    """With bf16 hardware (forced here: torch's bf16 GEMM runs anywhere, only slower) a bf16 input of
    W4_DENSE_ROWS_BF16 rows takes the dense path in bf16: the weight rounded to bf16 (~2^-9 of each value), fp32
    sums, the fp32 bias added before the output's rounding; fp32 inputs keep the exact fp32 GEMM."""
    monkeypatch.setattr(cpu_native, "bf16_gemm_native", lambda: True)
    assert cpu_native.dense_rows(torch.bfloat16) == cpu_native.W4_DENSE_ROWS_BF16 < cpu_native.W4_DENSE_ROWS
    assert cpu_native.dense_rows(torch.float32) == cpu_native.W4_DENSE_ROWS
    qweight, scales, zeros = w4_weight(208, 576, 32)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    x = torch.randn(cpu_native.W4_DENSE_ROWS_BF16, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(208) * 100  # large enough that rounding it to bf16 first would show
    want = x.float() @ ref.dequantize_w4_dm16(qweight, scales, zeros).float().t() + bias
    got = quant_linear(x, prepared, bias, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    assert rel_err(got, want) < (3e-3 if out_dtype == torch.bfloat16 else 5e-4)  # a bias rounded first: 1.5e-3
    calls = []
    monkeypatch.setattr(cpu_native, "_w4_dense", lambda *a: calls.append(a) or torch.zeros(len(a[1]), 208))
    quant_linear(x[:-1], prepared)  # one row fewer: the block products
    assert not calls
    quant_linear(x, prepared)
    assert len(calls) == 1


@needs_native
def test_act_order_bias_dtypes_and_3d_inputs() -> None:
    qweight, scales, zeros = w4_weight(64, 256, 32)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    prepared = prepare_w4_cpu(qweight, scales, zeros, input_perm=perm)
    x = torch.randn(2, 3, 256)
    bias = torch.randn(64).bfloat16()  # a bf16 bias (Qwen's q/k/v) is widened, not rounded further
    want = ref.w4_act_gemm(x[..., perm].reshape(6, 256), qweight, scales, zeros, bias.float()).reshape(2, 3, 64)
    got = quant_linear(x, prepared, bias)
    assert got.shape == (2, 3, 64) and rel_err(got, want) < 1e-6
    half = quant_linear(x.half(), prepared)  # fp16 activations are widened to fp32 first
    assert half.dtype == torch.float16 and rel_err(half, want - bias.float()) < 1e-3


def test_the_switch_and_odd_scales_keep_torchs_int4_gemm() -> None:
    """``LIGHTINFER_CPU_W4=torch``, and any machine without the C library, keeps torch's layout with bf16
    activations; so do scales that fp16 would not hold (below its normal range)."""
    qweight, scales, zeros = w4_weight(64, 256, 32)
    with switches.override(cpu_w4="torch"):
        assert isinstance(prepare_w4_cpu(qweight, scales, zeros), CpuQuantWeight)
    with switches.override(cpu_native=False):
        assert isinstance(prepare_w4_cpu(qweight, scales, zeros), CpuQuantWeight)
    if cpu_native.library() is not None:
        assert isinstance(prepare_w4_cpu(qweight, scales, zeros), CpuW4Weight)
        tiny = scales.clone()
        tiny[0, 0] = 1e-6
        assert isinstance(prepare_w4_cpu(qweight, tiny, zeros), CpuQuantWeight)


def test_an_unknown_product_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="LIGHTINFER_CPU_W4='fast' is not a CPU 4-bit product; use one of c, int8, torch"):
        switches.KernelSwitches.from_env({"LIGHTINFER_CPU_W4": "fast"})
    assert switches.KernelSwitches.from_env({"LIGHTINFER_CPU_W4": "int8"}).cpu_w4 == "int8"
    assert switches.KernelSwitches.from_env({}).cpu_w4 == "c"


@needs_native
@pytest.mark.parametrize("mode", ["c", "int8"])
def test_the_c_layouts_keep_the_memory_of_torchs(mode: str) -> None:
    qweight, scales, zeros = w4_weight(256, 576, 32)
    with switches.override(cpu_w4=mode):
        c = prepare_w4_cpu(qweight, scales, zeros)
    with switches.override(cpu_w4="torch"):
        t = prepare_w4_cpu(qweight, scales, zeros)
    assert isinstance(c, CpuW4Weight) and isinstance(t, CpuQuantWeight)
    assert c.nbytes <= t.nbytes
