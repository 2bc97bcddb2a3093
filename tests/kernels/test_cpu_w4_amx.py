"""The 4-bit product of many bf16 rows on Intel AMX tiles (``native/cpu_w4_amx.c``, ``cpu_native.w4_linear``):
the twin (the weight dequantized to bf16, fp32 sums) at shapes that leave partial tiles, where it takes over
from the block products, and its switch. Skipped on a CPU without AMX (or where Linux does not grant it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightinfer.kernels import cpu_native, prepare_w4_cpu, switches
from lightinfer.kernels import reference as ref
from lightinfer.kernels.cpu_lowbit import quant_linear
from tests.kernels.test_cpu_w4 import rel_err, w4_weight

pytestmark = pytest.mark.skipif(cpu_native.find_compiler() is None or not cpu_native.amx_available(),
                                reason="no AMX-BF16 on this CPU (or no C compiler)")


@pytest.fixture(autouse=True)
def _amx_product() -> Iterator[None]:
    with switches.override(cpu_w4="c", cpu_native=True, cpu_amx=True):
        yield


def _twin(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
          bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 x bf16 with fp32 sums: the weight d * q + m rounded once to bf16, as the kernel's tiles hold it."""
    w = ref.dequantize_w4_dm16(qweight, scales, zeros).float().bfloat16().float()
    y = x.float() @ w.t()
    return y if bias is None else y + bias


@pytest.mark.parametrize(("rows", "n", "k", "g"), [
    (8, 96, 576, 32),      # one partial block of x's rows, K = 2 super-blocks + 2 plain blocks
    (37, 960, 576, 64),    # rows past one block of 32, N a whole number of 32-row blocks
    (129, 48, 320, 32),    # N not a multiple of 32: zero rows of W padding the last block
    (13, 576, 1536, 128),  # a down projection's K
    (64, 16, 96, 32),      # K with no super-block at all, N one tile
])
def test_the_amx_product_is_its_twin(rows: int, n: int, k: int, g: int) -> None:
    """Products exact in fp32, sums in another order than the twin's: fp32 outputs within 1e-5 (measured
    ~3e-7), bf16 outputs within their rounding."""
    qweight, scales, zeros = w4_weight(n, k, g, seed=rows)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(n) * 10
    want = _twin(x, qweight, scales, zeros, bias)
    got = quant_linear(x, prepared, bias, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert rel_err(got, want) < 1e-5
    got_bf16 = quant_linear(x, prepared, None)
    assert got_bf16.dtype == torch.bfloat16
    assert rel_err(got_bf16, want - bias) < 4e-3


def test_amx_takes_over_from_the_block_products_at_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 inputs of W4_AMX_ROWS rows or more run on the tiles, fewer on the block products; fp32 inputs keep
    the exact paths; LIGHTINFER_CPU_AMX=0 gives the dense path back to torch's GEMM from W4_DENSE_ROWS_BF16."""
    assert cpu_native.dense_rows(torch.bfloat16) == cpu_native.W4_AMX_ROWS
    assert cpu_native.dense_path_native(torch.bfloat16) and not cpu_native.dense_path_native(torch.float32)
    assert cpu_native.dense_rows(torch.float32) == cpu_native.W4_DENSE_ROWS
    lib = cpu_native.library()
    calls: list[int] = []
    inner = lib.li_w4_amx_linear
    monkeypatch.setattr(lib, "li_w4_amx_linear", lambda *a: calls.append(a[1]) or inner(*a))
    qweight, scales, zeros = w4_weight(64, 256, 32)
    prepared = prepare_w4_cpu(qweight, scales, zeros)
    x = torch.randn(cpu_native.W4_AMX_ROWS, 256).bfloat16()
    quant_linear(x[:-1], prepared)
    quant_linear(x.float(), prepared)
    assert calls == []
    quant_linear(x, prepared)
    assert calls == [cpu_native.W4_AMX_ROWS]
    with switches.override(cpu_amx=False):
        assert not cpu_native.amx_available()
        assert cpu_native.dense_rows(torch.bfloat16) == cpu_native.W4_DENSE_ROWS_BF16
        assert rel_err(quant_linear(x, prepared), _twin(x, qweight, scales, zeros, None)) < 4e-3
    assert calls == [cpu_native.W4_AMX_ROWS]
