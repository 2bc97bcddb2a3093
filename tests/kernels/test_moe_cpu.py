"""The ``torch_cpu`` backend's mixture of experts (``kernels/moe_cpu.py``) against ``reference.fused_moe``: each
expert on its routed tokens only, with dense, oneDNN, torch-int4 and C-product prepared weights."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import cpu_native, get_backend
from lightinfer.kernels import reference as ref
from lightinfer.kernels.moe_cpu import (
    c_product_available,
    choose_kind,
    int4_gemm_available,
    onednn_available,
    prepare_experts,
    prepared_for,
)
from tests.kernels.test_triton_fused_moe import TOL, dense_experts, routed, w4_experts


def w4_kind(n: int, group_size: int) -> str:
    """What a W4 stack with 16-bit activations becomes here: the C product, else torch's int4 GEMM, else dense."""
    if c_product_available() and group_size % 32 == 0:
        return "c"
    return "int4" if int4_gemm_available() and n % 16 == 0 else "dense"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 4, 37])
def test_w4_matches_reference(dtype: torch.dtype, t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    e, h, inter = 8, 64, 32
    w13 = w4_experts(e, 2 * inter, h, 32, dtype, gen, fractional=True)
    w2 = w4_experts(e, h, inter, 32, dtype, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights, ids = routed(t, e, 2, gen)
    got = get_backend("torch_cpu").fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), ref.fused_moe(x, w13, w2, weights, ids).float(), **TOL[dtype])
    # fp32: oneDNN's prepacked GEMM (exact); 16-bit: the C product or torch's int4 GEMM, half a byte per weight
    want_kind = w4_kind(2 * inter, 32) if dtype != torch.float32 else ("onednn" if onednn_available() else "dense")
    assert w13.prepared.kind == w2.prepared.kind == want_kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_match_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    w13, w2 = dense_experts(4, 40, 24, dtype, gen), dense_experts(4, 24, 20, dtype, gen)
    x = torch.randn(9, 24, generator=gen).to(dtype)
    weights, ids = routed(9, 4, 2, gen)
    got = get_backend("torch_cpu").fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), ref.fused_moe(x, w13, w2, weights, ids).float(), **TOL[dtype])


def test_only_routed_experts_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step of one token with top-2 of 16 experts runs 2 x 2 expert GEMMs, not 16 x 2."""
    from lightinfer.kernels import moe_cpu

    gen = torch.Generator().manual_seed(8)
    w13, w2 = w4_experts(16, 64, 32, 32, torch.float32, gen), w4_experts(16, 32, 32, 32, torch.float32, gen)
    calls: list[int] = []
    original = moe_cpu.CpuExperts.matmul
    monkeypatch.setattr(moe_cpu.CpuExperts, "matmul", lambda self, e, x: calls.append(e) or original(self, e, x))
    weights, ids = routed(1, 16, 2, gen)
    get_backend("torch_cpu").fused_moe(torch.randn(1, 32, generator=gen), w13, w2, weights, ids)
    assert sorted(calls) == sorted(ids[0].tolist() * 2)


def test_prepared_once_and_kinds() -> None:
    gen = torch.Generator().manual_seed(9)
    w = w4_experts(2, 48, 64, 32, torch.bfloat16, gen)
    assert choose_kind(w, torch.bfloat16) == w4_kind(48, 32)
    assert choose_kind(w, torch.float32) == ("onednn" if onednn_available() else "dense")
    odd = w4_experts(2, 40, 64, 32, torch.bfloat16, gen)  # N not a multiple of 16: torch's int4 GEMM refuses
    assert choose_kind(odd, torch.bfloat16) == w4_kind(40, 32)
    from lightinfer.kernels import switches

    with switches.override(cpu_w4="torch"):
        assert choose_kind(odd, torch.bfloat16) == "dense" and choose_kind(w, torch.bfloat16) == (
            "int4" if int4_gemm_available() else "dense")
    first = prepared_for(w, torch.bfloat16)
    assert prepared_for(w, torch.bfloat16) is first  # kept, not made again
    dense = prepare_experts(w, torch.float32, "dense")
    torch.testing.assert_close(dense.weight[1], ref.dequantize_w4(w.qweight[1], w.scales[1], w.zeros[1]).float())


@pytest.mark.parametrize("kind", ["dense", "onednn"])
def test_fp32_kinds_agree(kind: str) -> None:
    if kind == "onednn" and not onednn_available():
        pytest.skip("no oneDNN prepacked GEMM in this torch build")
    gen = torch.Generator().manual_seed(10)
    w13, w2 = w4_experts(4, 64, 32, 32, torch.float32, gen), dense_experts(4, 32, 32, torch.float32, gen)
    w13.prepared, w2.prepared = prepare_experts(w13, torch.float32, kind), prepare_experts(w2, torch.float32, kind)
    x = torch.randn(6, 32, generator=gen)
    weights, ids = routed(6, 4, 2, gen)
    torch.testing.assert_close(get_backend("torch_cpu").fused_moe(x, w13, w2, weights, ids),
                               ref.fused_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler: the C 4-bit product is not built")
@pytest.mark.parametrize("int8", [False, True])
def test_the_c_product_serves_experts_as_the_dense_layers(int8: bool) -> None:
    """The ``c`` form (the decoder's 4-bit product) against the reference; with ``LIGHTINFER_CPU_W4=int8`` its
    activations are int8 per block of 32 (looser)."""
    from lightinfer.kernels import switches

    gen = torch.Generator().manual_seed(11)
    w13 = w4_experts(4, 96, 64, 32, torch.bfloat16, gen, fractional=True)
    w2 = w4_experts(4, 64, 48, 16, torch.bfloat16, gen)  # K = 48: no group of 32 fits, torch's int4 or dense
    with switches.override(cpu_w4="int8" if int8 else "c"):
        w13.prepared, w2.prepared = prepare_experts(w13, torch.bfloat16), prepare_experts(w2, torch.bfloat16)
    assert w13.prepared.kind == "c" and w13.prepared.int8_activations == int8 and w2.prepared.kind != "c"
    assert w13.prepared.nbytes() == 4 * (96 * 64 // 2 + 2 * 96 * 2 * 2)  # codes, and an fp16 (d, m) per group
    x = torch.randn(7, 64, generator=gen).bfloat16()
    weights, ids = routed(7, 4, 2, gen)
    got = get_backend("torch_cpu").fused_moe(x, w13, w2, weights, ids).float()
    want = ref.fused_moe(x, w13, w2, weights, ids).float()
    assert float((got - want).norm() / want.norm()) < (3e-2 if int8 else 1e-2)
