"""RMSNorm, fused add + RMSNorm, rotary and SiLU-and-mul against their twins under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import norm_rope as nr
from lightinfer.kernels import reference as ref

# The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): allow 2 bf16 ulps.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 72), (7, 576)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    torch.testing.assert_close(nr.rms_norm(x, w, 1e-6).float(), ref.rms_norm(x, w, 1e-6).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_leaves_inputs(dtype: torch.dtype) -> None:
    x, r = torch.randn(5, 200).to(dtype), torch.randn(5, 200).to(dtype)
    w = torch.rand(200).to(dtype)
    x0, r0 = x.clone(), r.clone()
    out, res = nr.fused_add_rms_norm(x, r, w, 1e-5)
    out_ref, res_ref = ref.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(res.float(), res_ref.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens,hq,hk,head_dim", [(1, 1, 1, 16), (6, 9, 3, 64), (3, 4, 4, 80), (0, 4, 2, 32)])
def test_rotary_qk_matches_gathered_apply_rotary(dtype: torch.dtype, pos_dtype: torch.dtype, tokens: int, hq: int,
                                                 hk: int, head_dim: int) -> None:
    """q and k rotated in one launch, tables read at the positions in the kernel: the same as
    gathering the tables and rotating each; q and k are strided views of one fused qkv output."""
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim).to(dtype)
    q = qkv[:, :hq * head_dim].reshape(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hk) * head_dim].reshape(tokens, hk, head_dim)
    freqs = torch.arange(100).float().unsqueeze(1) * 10000.0 ** (-torch.arange(head_dim // 2).float() / (head_dim // 2))
    cos_cache, sin_cache = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 100, (tokens,)).to(pos_dtype)  # chunked prefill / decode: any positions
    q0, k0 = q.clone(), k.clone()
    got_q, got_k = nr.rotary_qk(positions, q, k, cos_cache, sin_cache)
    want_q, want_k = ref.rotary_qk(positions, q, k, cos_cache, sin_cache)
    torch.testing.assert_close(got_q.float(), want_q.float(), **TOL[dtype])
    torch.testing.assert_close(got_k.float(), want_k.float(), **TOL[dtype])
    assert got_q.shape == q.shape and got_k.shape == k.shape and torch.equal(q, q0) and torch.equal(k, k0)


def test_rotary_qk_validation_errors() -> None:
    q, k, c = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(10, 4)
    pos = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="positions"):
        nr.rotary_qk(pos.float(), q, k, c, c)
    with pytest.raises(ValueError, match="q \\[T, Hq, D\\]"):
        nr.rotary_qk(pos, q, torch.randn(2, 2, 6), c, c)
    with pytest.raises(ValueError, match="cos_cache"):
        nr.rotary_qk(pos, q, k, torch.randn(10, 5), torch.randn(10, 5))  # more than D // 2 angles
    with pytest.raises(ValueError, match="cos_cache"):
        nr.rotary_qk(pos, q, k, torch.randn(10, 3), c)  # cos and sin disagree


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 1100), (2, 3, 2 * 72)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (torch.randn(shape) * 4).to(dtype)
    torch.testing.assert_close(nr.silu_and_mul(x).float(), ref.silu_and_mul(x).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_ops_sum_split_k_partials_like_the_reduction(dtype: torch.dtype, with_bias: bool) -> None:
    """fused_add_rms_norm and silu_and_mul take a GEMM's unreduced partials: the same result, bit for
    bit, as reducing first (splits summed in order, bias, rounded to the output dtype)."""
    from lightinfer.kernels import SplitKPartials

    g = torch.Generator().manual_seed(3)
    bias = torch.randn(96, generator=g).to(dtype) if with_bias else None
    parts = SplitKPartials(torch.randn(3, 5, 96, generator=g), bias, dtype)
    r, w = torch.randn(5, 96, generator=g).to(dtype), torch.rand(96, generator=g).to(dtype)
    out, res = nr.fused_add_rms_norm(parts, r, w, 1e-6)
    out_ref, res_ref = nr.fused_add_rms_norm(parts.reduced(), r, w, 1e-6)
    assert torch.equal(res, res_ref) and torch.equal(out, out_ref)
    assert torch.equal(nr.silu_and_mul(parts), nr.silu_and_mul(parts.reduced()))
    assert torch.equal(ref.silu_and_mul(parts), ref.silu_and_mul(parts.reduced()))


def test_validation_errors() -> None:
    with pytest.raises(ValueError):
        nr.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError):
        nr.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)
    with pytest.raises(ValueError):
        nr.rotary_qk(torch.tensor([0, 1]), torch.randn(2, 1, 7), torch.randn(2, 1, 7), torch.randn(4, 3),
                     torch.randn(4, 3))
    with pytest.raises(ValueError):
        nr.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError):
        nr.rms_norm(torch.randint(0, 3, (2, 8)), torch.randn(8), 1e-6)
