"""The CPU engine's speed paths compute the same thing as the plain forms they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightinfer.engine.cpu_malloc import tune_malloc_for_cpu_inference
from lightinfer.kernels import reference as ref
from lightinfer.layers.cpu_gemm import PackedWeight, onednn_gemm_available
from lightinfer.layers.linear import Linear, W4A16Linear, fuse_linears


def _dense(i: int, o: int, bias: bool, gen: torch.Generator) -> Linear:
    layer = Linear(i, o, bias, torch.float32)
    layer.weight.data = torch.randn(o, i, generator=gen)
    if bias:
        layer.bias.data = torch.randn(o, generator=gen)
    return layer


def _w4(i: int, o: int, gen: torch.Generator) -> W4A16Linear:
    layer = W4A16Linear(i, o, False, 32, torch.float32)
    layer.qweight = torch.randint(-2**31, 2**31 - 1, (o, i // 8), dtype=torch.int32, generator=gen)
    layer.scales = torch.rand(i // 32, o, generator=gen) * 0.01
    layer.zeros = torch.randint(0, 16, (i // 32, o), generator=gen).float()
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_fused_dense_linear_equals_concatenated_outputs(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [_dense(64, n, bias, gen) for n in (64, 16, 16)]
    x = torch.randn(5, 64, generator=gen)
    fused = fuse_linears(parts)
    assert fused is not None and fused.out_features == 96
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)


def test_fused_w4_linear_equals_concatenated_outputs() -> None:
    gen = torch.Generator().manual_seed(1)
    parts = [_w4(64, 24, gen), _w4(64, 40, gen)]
    x = torch.randn(3, 64, generator=gen)
    fused = fuse_linears(parts)
    assert isinstance(fused, W4A16Linear) and fused.qweight.shape == (64, 8)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-4)


def test_mixed_dense_and_w4_are_not_fused() -> None:
    gen = torch.Generator().manual_seed(2)
    assert fuse_linears([_dense(64, 24, False, gen), _w4(64, 24, gen)]) is None


@pytest.mark.skipif(not onednn_gemm_available(), reason="oneDNN prepacked GEMM not available on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(3)
    layer = _dense(96, 40, True, gen)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack_for_cpu()
    assert layer.weight is None  # released: memory does not double
    x = torch.randn(2, rows, 96, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert PackedWeight(w).nbytes == w.numel() * 4


def _paged(lens: list[int], num_kv_heads: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    block_size, head_dim = 4, 8
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max((n + block_size - 1) // block_size for n in lens)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = (n + block_size - 1) // block_size
        tables[i, :nb] = perm[used: used + nb].int()
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return k_cache.to(dtype), v_cache.to(dtype), tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("lens", [[3, 50, 7, 7, 1, 33], [1, 2, 3, 4, 90, 91], [17]])
def test_grouped_decode_equals_one_sequence_at_a_time(lens: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny padding budget: many groups; unsorted lengths: the argsort path; sorted: the slice path.
    monkeypatch.setattr(ref, "DECODE_PAD_TOKENS", 8)
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, tables, context_lens = _paged(lens, 2, torch.float32, gen)
    q = torch.randn(len(lens), 6, 8, generator=gen)
    out = ref.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.3)
    for i, n in enumerate(lens):
        k = ref.gather_kv(k_cache, tables[i], n, None, None, torch.float32)
        v = ref.gather_kv(v_cache, tables[i], n, None, None, torch.float32)
        expect = ref._attend(q[i: i + 1], k, v, 0.3, causal_offset=n - 1)[0]
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)


def test_decode_plan_is_recomputed_when_tables_change_in_place() -> None:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables, context_lens = _paged([9, 12], 1, torch.float32, gen)
    q = torch.randn(2, 2, 8, generator=gen)
    first = ref.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.5)
    tables[[0, 1]] = tables[[1, 0]].clone()  # swap the two sequences' blocks in place
    context_lens[[0, 1]] = context_lens[[1, 0]].clone()
    second = ref.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.5)
    assert not torch.allclose(first, second)
    swapped = ref.paged_attention_decode(q[[1, 0]], k_cache, v_cache, tables, context_lens, 0.5)
    torch.testing.assert_close(swapped[[1, 0]], first, rtol=1e-6, atol=1e-6)


def test_malloc_tuning_is_idempotent() -> None:
    first = tune_malloc_for_cpu_inference()
    assert tune_malloc_for_cpu_inference() == first
    big = torch.ones(2048, 576)  # allocations still work afterwards
    assert float(F.rms_norm(big, (576,)).sum()) == pytest.approx(2048 * 576, rel=1e-5)
