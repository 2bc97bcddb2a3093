"""Paged attention decode/prefill against the reference twins under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import PagedKV
from lightinfer.kernels import reference as ref
from lightinfer.kernels.attention_plan import (
    MAX_DECODE_SPLITS,
    MIN_PARTITION_SIZE,
    PARTITION_SIZE,
    decode_split_plan,
)
from lightinfer.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_impl,
    paged_attention_prefill,
)

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 3e-3, "rtol": 3e-3},
       torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def _cache(ctx_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype,
           dtype: torch.dtype, seed: int = 0):
    """Random K/V for every sequence, written into shuffled blocks (by the reference store: the kernel is
    tested on its own and is slow under the interpreter); table padded with -1. Returns the
    :class:`PagedKV`'s ``(k, v)``, the table, the lengths and its scales/zeros (four None for a float cache)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(ctx_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = (torch.randn(shape, generator=gen) * 100).to(cache_dtype)  # garbage everywhere first
    vc = (torch.randn(shape, generator=gen) * 100).to(cache_dtype)
    aux = [torch.rand(shape[:3], generator=gen).half() for _ in range(4)] if cache_dtype == torch.int8 else [None] * 4
    used = 0
    for s, (n, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        table[s, :nb] = perm[used:used + nb].int()
        used += nb
        slots = table[s, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        ref.store_kvcache(k, v, PagedKV(kc, vc, *aux), slots)
    return kc, vc, table, torch.tensor(ctx_lens, dtype=torch.int32), aux


CACHES = [  # (cache dtype, query dtype)
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.int8, torch.float16),
    (torch.int8, torch.float32),
]


@pytest.mark.parametrize("cache_dtype,dtype", CACHES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode(cache_dtype: torch.dtype, dtype: torch.dtype, group: int) -> None:
    num_kv_heads = 2 if group < 8 else 1
    ctx = [1, 16, 17, 130]  # one token, exactly one block, crossing a block, several partitions
    kc, vc, table, lens, aux = _cache(ctx, num_kv_heads, 32, 16, cache_dtype, dtype, seed=group)
    q = torch.randn(len(ctx), num_kv_heads * group, 32).to(dtype)
    kv = PagedKV(kc, vc, *aux)
    want = ref.paged_attention_decode(q, kv, table, lens, 32**-0.5)
    got = paged_attention_decode(q, kv, table, lens, 32**-0.5)  # one partition per sequence
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    split = paged_attention_decode_impl(q, kv, table, lens, 32**-0.5, partition_size=64)  # + reduction
    torch.testing.assert_close(split.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("head_dim,block_size", [(80, 8), (64, 1)])
def test_decode_odd_head_dim_and_block_size(head_dim: int, block_size: int) -> None:
    kc, vc, table, lens, aux = _cache([5, 23], 2, head_dim, block_size, torch.float16, torch.float16)
    q = torch.randn(2, 4, head_dim).half()
    kv = PagedKV(kc, vc, *aux)
    want = ref.paged_attention_decode(q, kv, table, lens, 0.1)
    torch.testing.assert_close(paged_attention_decode(q, kv, table, lens, 0.1).float(), want.float(),
                               **TOL[torch.float16])


def _int8_decode_and_prefill_match(ctx: list[int], q_lens: list[int], head_dim: int, num_kv_heads: int,
                                   num_heads: int, block_size: int, partition_size: int, scale: float) -> None:
    """INT8 cache: decode (one and split partitions) and prefill against the reference."""
    kc, vc, table, lens, aux = _cache(ctx, num_kv_heads, head_dim, block_size, torch.int8, torch.float16,
                                      seed=block_size)
    q = torch.randn(len(ctx), num_heads, head_dim).half()
    want = ref.paged_attention_decode(q, PagedKV(kc, vc, *aux), table, lens, scale)
    for kwargs in ({}, {"partition_size": partition_size}):
        got = paged_attention_decode_impl(q, PagedKV(kc, vc, *aux), table, lens, scale, **kwargs)
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(sum(q_lens), num_heads, head_dim).half()
    want = ref.paged_attention_prefill(qp, PagedKV(kc, vc, *aux), cu, lens, table, scale)
    got = paged_attention_prefill(qp, PagedKV(kc, vc, *aux), cu, lens, table, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


@pytest.mark.parametrize("block_size", [1, 8, 32, 128])
def test_int8_whole_page_and_fallback_gathers(block_size: int) -> None:
    """INT8 tiles are gathered page by page when a tile holds whole pages (block sizes 1, 8, 32 with
    64- and 32-key tiles) and token by token otherwise (128)."""
    _int8_decode_and_prefill_match([1, 9, 70, 200], [1, 5, 40, 33], 32, 2, 8, block_size, 128, 0.2)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_int8_head_dim_256(block_size: int) -> None:
    """The 32-key decode and 16-key INT8 prefill tiles of head_dim 256 at the engine's block sizes."""
    _int8_decode_and_prefill_match([3, 40, 70], [3, 17, 20], 256, 1, 2, block_size, 32, 0.06)


def test_decode_bf16() -> None:
    kc, vc, table, lens, aux = _cache([3, 40], 2, 32, 16, torch.bfloat16, torch.bfloat16)
    q = torch.randn(2, 8, 32).bfloat16()
    kv = PagedKV(kc, vc, *aux)
    want = ref.paged_attention_decode(q, kv, table, lens, 32**-0.5)
    torch.testing.assert_close(paged_attention_decode(q, kv, table, lens, 32**-0.5).float(), want.float(),
                               **TOL[torch.bfloat16])


@pytest.mark.parametrize("cache_dtype,dtype", CACHES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill(cache_dtype: torch.dtype, dtype: torch.dtype, group: int) -> None:
    num_kv_heads = 2 if group == 1 else 1
    q_lens = [1, 17, 70, 5]
    prefix = [0, 16, 3, 40]  # no prefix, block-aligned prefix-cache hit, ragged chunked-prefill prefixes
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    kc, vc, table, lens, aux = _cache(ctx, num_kv_heads, 32, 16, cache_dtype, dtype, seed=group)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, 32).to(dtype)
    want = ref.paged_attention_prefill(q, PagedKV(kc, vc, *aux), cu, lens, table, 32**-0.5)
    got = paged_attention_prefill(q, PagedKV(kc, vc, *aux), cu, lens, table, 32**-0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_prefill_single_token_sequences_equal_decode() -> None:
    kc, vc, table, lens, aux = _cache([1, 9, 33], 2, 32, 16, torch.int8, torch.float16)
    q = torch.randn(3, 4, 32).half()
    cu = torch.arange(4, dtype=torch.int32)
    pre = paged_attention_prefill(q, PagedKV(kc, vc, *aux), cu, lens, table, 0.2)
    dec = paged_attention_decode(q, PagedKV(kc, vc, *aux), table, lens, 0.2)
    torch.testing.assert_close(pre.float(), dec.float(), **TOL[torch.float16])


@pytest.mark.parametrize("case", ["heads", "head_dim", "aux", "table_dtype", "lens_shape", "cache_dtype"])
def test_validation_errors(case: str) -> None:
    kc, vc, table, lens, aux = _cache([3, 5], 2, 16, 4, torch.int8, torch.float16)
    q = torch.randn(2, 4, 16).half()
    if case == "heads":
        q = torch.randn(2, 3, 16).half()
    elif case == "head_dim":
        q = torch.randn(2, 4, 8).half()
    elif case == "aux":
        aux[1] = None
    elif case == "table_dtype":
        table = table.float()
    elif case == "lens_shape":
        lens = lens[:1]
    elif case == "cache_dtype":
        kc, vc = kc.to(torch.int16), vc.to(torch.int16)
    with pytest.raises(ValueError):
        paged_attention_decode(q, PagedKV(kc, vc, *aux), table, lens, 0.25)


def _head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the engine's GPU layout: [blocks, block_size, heads], head-major strides."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def test_head_major_scales_give_identical_results() -> None:
    """The kernels read the INT8 scale/zero tensors through their strides: the head-major layout
    the engine allocates on GPUs gives bit-identical decode (one and split partitions) and prefill."""
    kc, vc, table, lens, aux = _cache([1, 17, 130], 2, 32, 16, torch.int8, torch.float16, seed=5)
    hm = [_head_major(t) for t in aux]
    assert hm[0].stride() == (32, 1, 16) and not hm[0].is_contiguous()
    q = torch.randn(3, 8, 32).half()
    for kwargs in ({}, {"partition_size": 64}):
        a = paged_attention_decode_impl(q, PagedKV(kc, vc, *aux), table, lens, 0.2, **kwargs)
        b = paged_attention_decode_impl(q, PagedKV(kc, vc, *hm), table, lens, 0.2, **kwargs)
        assert torch.equal(a, b)
    cu = torch.tensor([0, 1, 9, 30], dtype=torch.int32)
    qp = torch.randn(30, 8, 32).half()
    assert torch.equal(paged_attention_prefill(qp, PagedKV(kc, vc, *aux), cu, lens, table, 0.2),
                       paged_attention_prefill(qp, PagedKV(kc, vc, *hm), cu, lens, table, 0.2))
    with pytest.raises(ValueError, match="same strides"):
        paged_attention_decode(q, PagedKV(kc, vc, hm[0], *aux[1:]), table, lens, 0.2)


def test_small_batches_split_the_real_context_whatever_the_table_width() -> None:
    # max_ctx is the block-table bound (max_model_len inside a CUDA graph), not the real context: small
    # batches get a fixed number of partitions that the kernel sizes from each sequence's real context.
    cpu = torch.device("cpu")  # the interpreter counts 4 SMs: fewer than 8 programs is "small"
    assert decode_split_plan(1, 2, 4096, cpu) == (4, 0) == decode_split_plan(1, 2, 131072, cpu)
    assert decode_split_plan(1, 1, 4096, cpu) == (8, 0)
    # larger batches: fixed partitions, never more than MAX_DECODE_SPLITS of them
    assert decode_split_plan(8, 2, 4096, cpu) == (4096 // PARTITION_SIZE, PARTITION_SIZE)
    assert decode_split_plan(8, 2, 200, cpu) == (1, 2 * MIN_PARTITION_SIZE)
    splits, part = decode_split_plan(8, 2, 131072, cpu)
    assert splits <= MAX_DECODE_SPLITS and part % MIN_PARTITION_SIZE == 0 and splits * part >= 131072


@pytest.mark.parametrize("ctx_lens", [[1, 65, 300], [1000, 7, 64]])
def test_adaptive_partitions_match_the_reference(ctx_lens: list[int]) -> None:
    # 3 sequences x 1 KV head = 3 programs < 8: the adaptive plan (3 partitions of each real context,
    # in whole 64-key tiles); a 1,024-token table is much wider than most contexts.
    gen = torch.Generator().manual_seed(len(ctx_lens))
    bs, d, hkv, h = 16, 32, 1, 4
    num_blocks = 1024 // bs
    table = torch.stack([torch.randperm(num_blocks * 4, generator=gen)[:num_blocks] for _ in ctx_lens]).int()
    k = torch.randn(num_blocks * 4, bs, hkv, d, generator=gen)
    v = torch.randn(num_blocks * 4, bs, hkv, d, generator=gen)
    q = torch.randn(len(ctx_lens), h, d, generator=gen)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    assert decode_split_plan(len(ctx_lens), hkv, 1024, torch.device("cpu"))[1] == 0
    got = paged_attention_decode(q, PagedKV(k, v), table, lens, d**-0.5)
    torch.testing.assert_close(got, ref.paged_attention_decode(q, PagedKV(k, v), table, lens, d**-0.5), atol=1e-5,
                               rtol=1e-5)
