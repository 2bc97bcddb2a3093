"""The fused-MoE Triton kernel (``kernels/fused_moe.py``) against its naive twin ``reference.fused_moe`` under
TRITON_INTERPRET=1, and the token sort it launches over (``kernels/moe.py``)."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import ExpertWeights
from lightinfer.kernels import reference as ref
from lightinfer.kernels.moe import moe_align_block_size, padded_size
from lightinfer.kernels.w4_layout import pack_int4_rows

TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 1e-2},
       torch.bfloat16: {"atol": 1.5e-1, "rtol": 3e-2}}


def w4_experts(e: int, n: int, k: int, g: int, dtype: torch.dtype, gen: torch.Generator,
               fractional: bool = False) -> ExpertWeights:
    """Random W4 experts: codes 0..15, scales ~0.02, integer zeros (or fractional ones, as GGUF Q4_K has)."""
    codes = torch.randint(0, 16, (e, n, k), generator=gen)
    scales = torch.rand(e, k // g, n, generator=gen) * 0.03 + 0.01
    zeros = torch.randint(0, 16, (e, k // g, n), generator=gen).float()
    if fractional:
        zeros = zeros + torch.rand(zeros.shape, generator=gen)
    return ExpertWeights(qweight=pack_int4_rows(codes), scales=scales.to(dtype), zeros=zeros.to(dtype))


def dense_experts(e: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> ExpertWeights:
    return ExpertWeights(weight=(torch.randn(e, n, k, generator=gen) * 0.1).to(dtype))


def routed(t: int, e: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(torch.randn(t, e, generator=gen), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("t,e,top_k,h,inter,g", [
    (1, 8, 2, 64, 32, 32),     # decode: one token, most experts idle
    (5, 4, 2, 128, 64, 64),    # a few tokens
    (40, 4, 2, 128, 32, 128),  # 80 pairs over 4 experts: the 64-row prefill tile
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_w4_matches_reference(t: int, e: int, top_k: int, h: int, inter: int, g: int, dtype: torch.dtype) -> None:
    from lightinfer.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(t + e)
    w13 = w4_experts(e, 2 * inter, h, g, dtype, gen, fractional=t == 5)
    w2 = w4_experts(e, h, inter, min(g, inter), dtype, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights, ids = routed(t, e, top_k, gen)
    got = fused_moe(x, w13, w2, weights, ids)
    want = ref.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, h)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert want.abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_experts_match_reference(dtype: torch.dtype) -> None:
    from lightinfer.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(3)
    e, h, inter, t = 4, 48, 24, 7  # sizes that are no multiple of the tiles: masked loads
    w13, w2 = dense_experts(e, 2 * inter, h, dtype, gen), dense_experts(e, h, inter, dtype, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights, ids = routed(t, e, 3, gen)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids).float(),
                               ref.fused_moe(x, w13, w2, weights, ids).float(), **TOL[dtype])


def test_fractional_zeros_are_exact() -> None:
    """A zero of q + 0.5 must not be rounded (the exponent trick of w4_decode would): fp32, tight tolerance."""
    from lightinfer.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(4)
    w13, w2 = w4_experts(2, 64, 32, 32, torch.float32, gen), w4_experts(2, 32, 32, 32, torch.float32, gen)
    w13.zeros = torch.full_like(w13.zeros, 7.5)
    x = torch.randn(3, 32, generator=gen)
    weights, ids = routed(3, 2, 1, gen)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref.fused_moe(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,e,top_k,block_m", [(1, 8, 2, 16), (9, 4, 3, 4), (33, 16, 2, 16), (6, 3, 3, 64)])
def test_moe_align_block_size(t: int, e: int, top_k: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(t)
    _, ids = routed(t, e, top_k, gen)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block_m, e)
    pairs = t * top_k
    assert sorted_ids.numel() == padded_size(pairs, e, block_m) and sorted_ids.numel() % block_m == 0
    used = int(num_post)
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum()) <= sorted_ids.numel()
    real = sorted_ids[:used][sorted_ids[:used] < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert bool((sorted_ids[used:] == pairs).all())
    flat = ids.flatten()
    for b in range(used // block_m):  # every tile holds pairs of its expert only
        tile = sorted_ids[b * block_m:(b + 1) * block_m]
        tile = tile[tile < pairs]
        assert bool((flat[tile.long()] == expert_ids[b]).all())


def test_bad_inputs_are_clear() -> None:
    from lightinfer.kernels.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(5)
    w13, w2 = w4_experts(2, 64, 32, 32, torch.float32, gen), w4_experts(2, 32, 32, 32, torch.float32, gen)
    weights, ids = routed(3, 2, 1, gen)
    with pytest.raises(ValueError, match="fused_moe: w13"):
        fused_moe(torch.randn(3, 48), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="fused_moe: topk_ids"):
        fused_moe(torch.randn(3, 32), w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="fused_moe: dense w13"):
        fused_moe(torch.randn(3, 32), dense_experts(2, 64, 32, torch.float16, gen),
                  dense_experts(2, 32, 32, torch.float32, gen), weights, ids)
