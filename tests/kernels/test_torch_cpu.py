"""The torch_cpu backend (the CPU engine's fast paths) against the naive reference backend."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import PagedKV, SplitKPartials, torch_cpu
from lightinfer.kernels import reference as ref


def _paged(lens: list[int], num_kv_heads: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """A float cache of random K/V (block size 4, head_dim 8) with each sequence's blocks shuffled."""
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
    return PagedKV(k_cache.to(dtype), v_cache.to(dtype)), tables, torch.tensor(lens, dtype=torch.int32)


def _int8_paged(lens: list[int], gen: torch.Generator) -> tuple:
    """An INT8 cache (2 KV heads, head_dim 8, block size 4) filled by the reference store."""
    kv, tables, context_lens = _paged(lens, 2, torch.float32, gen)
    q8 = PagedKV(torch.zeros_like(kv.k, dtype=torch.int8), torch.zeros_like(kv.v, dtype=torch.int8),
                 *[torch.zeros(kv.k.shape[:3], dtype=torch.float16) for _ in range(4)])
    for i, n in enumerate(lens):
        slots = tables[i, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
        ref.store_kvcache(torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen), q8, slots)
    return q8, tables, context_lens


@pytest.mark.parametrize("lens", [[3, 50, 7, 7, 1, 33], [1, 2, 3, 4, 90, 91], [17]])
def test_grouped_decode_equals_one_sequence_at_a_time(lens: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny padding budget: many groups; unsorted lengths: the argsort path; sorted: the slice path.
    monkeypatch.setattr(torch_cpu, "DECODE_PAD_TOKENS", 8)
    gen = torch.Generator().manual_seed(4)
    kv, tables, context_lens = _paged(lens, 2, torch.float32, gen)
    q = torch.randn(len(lens), 6, 8, generator=gen)
    out = torch_cpu.paged_attention_decode(q, kv, tables, context_lens, 0.3)
    for i, n in enumerate(lens):
        k, v = ref.gather_kv(kv, tables[i], n, torch.float32)
        expect = ref.attend(q[i: i + 1], k, v, 0.3, causal_offset=n - 1)[0]
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5)


def test_decode_plan_is_recomputed_when_tables_change_in_place() -> None:
    gen = torch.Generator().manual_seed(5)
    kv, tables, context_lens = _paged([9, 12], 1, torch.float32, gen)
    q = torch.randn(2, 2, 8, generator=gen)
    first = torch_cpu.paged_attention_decode(q, kv, tables, context_lens, 0.5)
    tables[[0, 1]] = tables[[1, 0]].clone()  # swap the two sequences' blocks in place
    context_lens[[0, 1]] = context_lens[[1, 0]].clone()
    second = torch_cpu.paged_attention_decode(q, kv, tables, context_lens, 0.5)
    assert not torch.allclose(first, second)
    swapped = torch_cpu.paged_attention_decode(q[[1, 0]], kv, tables, context_lens, 0.5)
    torch.testing.assert_close(swapped[[1, 0]], first, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("int8", [False, True])
def test_decode_and_prefill_match_the_reference(int8: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    lens = [5, 18, 1, 33]
    kv, tables, context_lens = _int8_paged(lens, gen) if int8 else _paged(lens, 2, torch.float32, gen)
    q = torch.randn(len(lens), 6, 8, generator=gen)
    torch.testing.assert_close(torch_cpu.paged_attention_decode(q, kv, tables, context_lens, 0.4),
                               ref.paged_attention_decode(q, kv, tables, context_lens, 0.4), rtol=1e-5, atol=1e-5)
    q_lens = [2, 18, 1, 10]  # new tokens; the rest of each context is a cached prefix
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(sum(q_lens), 6, 8, generator=gen)
    torch.testing.assert_close(torch_cpu.paged_attention_prefill(qp, kv, cu, context_lens, tables, 0.4),
                               ref.paged_attention_prefill(qp, kv, cu, context_lens, tables, 0.4), rtol=1e-5, atol=1e-5)


def test_varlen_attention_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(12, 4, 8, generator=gen), torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8,
                                                                                                     generator=gen)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    torch.testing.assert_close(torch_cpu.varlen_causal_attention(q, k, v, cu, 0.35),
                               ref.varlen_causal_attention(q, k, v, cu, 0.35), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_store_and_rope_store_are_the_reference_bit_for_bit(int8: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    d, hq, hk, t = 8, 4, 2, 6

    def cache() -> PagedKV:
        dt = torch.int8 if int8 else torch.float32
        scales = [torch.zeros(5, 4, hk, dtype=torch.float16) for _ in range(4)] if int8 else []
        return PagedKV(torch.zeros(5, 4, hk, d, dtype=dt), torch.zeros(5, 4, hk, d, dtype=dt), *scales)

    qkv = SplitKPartials(torch.randn(2, t, (hq + 2 * hk) * d, generator=gen), None, torch.float32)
    positions = torch.tensor([0, 3, 9, 2, 7, 1])
    slots = torch.tensor([0, 5, -1, 19, 7, 2])
    freqs = torch.outer(torch.arange(16.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    a, b = cache(), cache()
    qa = torch_cpu.rope_store_kvcache(positions, qkv, hq, hk, freqs.cos(), freqs.sin(), a, slots)
    qb = ref.rope_store_kvcache(positions, qkv, hq, hk, freqs.cos(), freqs.sin(), b, slots)
    assert torch.equal(qa, qb)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def test_norms_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(9)
    x, r, w = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen), torch.rand(64, generator=gen)
    torch.testing.assert_close(torch_cpu.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    for got, want in zip(torch_cpu.fused_add_rms_norm(x, r, w, 1e-6), ref.fused_add_rms_norm(x, r, w, 1e-6)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_store_takes_head_major_scales() -> None:
    """The GPU layout of the INT8 scales (head-major strides) is written like the contiguous one."""
    gen = torch.Generator().manual_seed(10)
    key, value = torch.randn(5, 3, 8, generator=gen), torch.randn(5, 3, 8, generator=gen)
    slots = torch.tensor([0, 9, -1, 14, 3])

    def cache(head_major: bool) -> PagedKV:
        scales = [torch.zeros(4, 3, 4, dtype=torch.float16).transpose(1, 2) if head_major else
                  torch.zeros(4, 4, 3, dtype=torch.float16) for _ in range(4)]
        return PagedKV(torch.zeros(4, 4, 3, 8, dtype=torch.int8), torch.zeros(4, 4, 3, 8, dtype=torch.int8), *scales)

    a, b = cache(False), cache(True)
    torch_cpu.store_kvcache(key, value, a, slots)
    torch_cpu.store_kvcache(key, value, b, slots)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    assert a.k_scale.abs().sum() > 0
