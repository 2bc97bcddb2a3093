"""linear_nbytes' CPU copy equals what a built layer holds after the CPU preparation, the shapes torch's int4
GEMM cannot take included (they keep a dense copy: Q6_K's groups of 16 in a Q4_K_M file)."""

from __future__ import annotations

import pytest
import torch

from lightinfer.engine.model_runner import dequantized_linear_bytes
from lightinfer.formats.scheme import LINEAR_FORMATS_KEY, LinearFormat
from lightinfer.kernels.cpu_lowbit import int4_gemm_available
from lightinfer.layers.linear import linear_nbytes, make_linear


@pytest.mark.skipif(not int4_gemm_available(), reason="this torch has no CPU int4 GEMM")
@pytest.mark.parametrize("kind,group,n", [("w4", 32, 64), ("w4", 32, 72), ("w8", 32, 64), ("w8", 16, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_copy_estimate_matches_the_prepared_layer(kind: str, group: int, n: int, dtype: torch.dtype) -> None:
    k = 128
    qc = {LINEAR_FORMATS_KEY: {"x": LinearFormat(kind, group, False, "GGUF")}}
    layer = make_linear(k, n, False, dtype, qc, "x")
    torch.manual_seed(0)
    layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, dtype=torch.int32) if kind == "w4"
                        else torch.randint(-128, 127, layer.qweight.shape, dtype=torch.int8))
    layer.scales.copy_(torch.rand(layer.scales.shape) * 0.01 + 0.001)
    layer.pack_for_cpu()
    _, cpu_dense = linear_nbytes(k, n, False, dtype, qc, "x")
    assert cpu_dense == dequantized_linear_bytes(layer)
