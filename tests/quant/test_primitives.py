"""Group quantization and the AutoAWQ "gemm" layout: round trips, edge cases, and bit-for-bit
equality with AutoAWQ 0.2.9's own packing and Triton GEMM (optional oracle, see conftest)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightinfer.kernels.reference import dequantize_w4, repack_awq_to_runtime
from lightinfer.quant.primitives import (
    dequantize,
    dequantize_groups,
    fake_quantize,
    pack,
    quantize_groups,
    quantize_linear_weight,
    unpack,
)


def _random_codes(n: int, k: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // g, generator=gen) * 0.05 + 1e-3).to(torch.float16)
    return codes, scales, zeros


@settings(max_examples=25, deadline=None)
@given(n8=st.integers(1, 6), groups=st.integers(1, 4), g=st.sampled_from([32, 64, 128]), seed=st.integers(0, 999))
def test_pack_unpack_round_trip(n8: int, groups: int, g: int, seed: int) -> None:
    codes, scales, zeros = _random_codes(8 * n8, g * groups, g, seed)
    qweight, qzeros, s = pack(codes, scales, zeros)
    assert qweight.dtype == torch.int32 and qweight.shape == (g * groups, n8)
    assert qzeros.shape == (groups, n8) and s.shape == (groups, 8 * n8) and s.dtype == torch.float16
    c2, s2, z2 = unpack(qweight, qzeros, s)
    assert torch.equal(c2, codes) and torch.equal(z2, zeros) and torch.equal(s2, scales)
    # our disk layout -> the engine's run-time layout -> the same dense weight
    qw_rt, s_rt, z_rt = repack_awq_to_runtime(qweight, qzeros, s, torch.float32)
    assert torch.equal(dequantize_w4(qw_rt, s_rt, z_rt), dequantize(qweight, qzeros, s))


@pytest.mark.parametrize("g", [32, 64, 128])
def test_quantize_error_bounded_and_idempotent(g: int) -> None:
    w = torch.randn(48, 256) * 0.02
    w[3, :g] = 0.0  # an all-zero group
    w[5, 7] = 0.5  # an outlier
    codes, scales, zeros = quantize_groups(w, g)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15 and int(zeros.max()) <= 15
    wq = dequantize_groups(codes, scales, zeros)
    step = scales.float().repeat_interleave(g, dim=1)
    assert bool(((wq - w).abs() <= 0.5 * step + 1e-6 + 1e-3 * w.abs()).all())
    assert torch.equal(wq[3, :g], torch.zeros(g))
    assert torch.equal(fake_quantize(w, g), wq)


def test_bad_inputs_named() -> None:
    w = torch.randn(16, 64)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight.*NaN"):
        quantize_linear_weight(w, 32, "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="not divisible by group_size 128"):
        quantize_linear_weight(torch.randn(16, 96), 128, "x")
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_linear_weight(torch.randn(12, 64), 32, "x")


def test_packing_equals_autoawq(awq_oracle) -> None:  # type: ignore[no-untyped-def]
    """Bit for bit: AutoAWQ's WQLinear_GEMM.from_linear packs the same int32 words."""
    for seed, (n, k, g) in enumerate([(64, 128, 32), (96, 256, 64), (256, 384, 128), (32, 64, 64)]):
        codes, scales, zeros = _random_codes(n, k, g, seed)
        linear = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():  # a weight exactly on the grid, so AutoAWQ's rounding recovers our codes
            linear.weight.copy_(dequantize_groups(codes, scales, zeros))
        ref = awq_oracle.gemm.WQLinear_GEMM.from_linear(
            linear, 4, g, scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
        qweight, qzeros, s = pack(codes, scales, zeros)
        assert torch.equal(qweight, ref.qweight), (n, k, g)
        assert torch.equal(qzeros, ref.qzeros), (n, k, g)
        assert torch.equal(s, ref.scales), (n, k, g)


def test_autoawq_triton_gemm_on_our_tensors(awq_oracle) -> None:  # type: ignore[no-untyped-def]
    """AutoAWQ's Triton GEMM (TRITON_INTERPRET=1, launched directly: its launcher needs CUDA)
    on our quantized tensors agrees with our dequantize + matmul."""
    import triton

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported (make test sets it)")
    torch.manual_seed(0)
    m, k, n, g = 16, 128, 64, 64
    q = quantize_linear_weight(torch.randn(n, k) * 0.05, g, "w")
    x = torch.randn(m, k).to(torch.float16)
    ours = x.float() @ dequantize(q["qweight"], q["qzeros"], q["scales"]).t()
    result = torch.zeros(m, n, dtype=torch.float16)
    grid = (triton.cdiv(m, 16) * triton.cdiv(n, 32), 1)
    awq_oracle.triton.awq_gemm_kernel[grid](
        x, q["qweight"], result, q["qzeros"], q["scales"], m, n, k, g,
        BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, SPLIT_K=1)
    rel = (result.float() - ours).norm() / ours.norm()
    assert float(rel) <= 1e-2, float(rel)
