"""The kernels added after ``test_kernels_gpu.py`` against their plain-PyTorch twins on a CUDA GPU at real model
shapes: the W8A16 GEMM (GGUF Q8_0 / Q6_K / Q5_K, 8-bit GPTQ) and sliding-window / soft-capped paged attention
(Gemma 2 / 3, Phi-3, Mistral). The fused MoE kernel has its own file (``test_moe_gpu.py``).

Skipped without CUDA, and under ``TRITON_INTERPRET=1`` (the interpreter at these shapes would take hours). Each
test's body is a ``check_*`` function taking the device and the shapes, so that
``tests/kernels/test_gpu_bodies_interpreted.py`` runs the same code under the interpreter at tiny shapes: code
that only ever runs on a GPU machine is otherwise first executed there, where a wrong argument costs device time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from lightinfer.kernels import KVCacheSpec, PagedKV
from lightinfer.kernels import reference as ref
from lightinfer.kernels.kv_store import store_kvcache
from lightinfer.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_impl,
    paged_attention_prefill,
)
from lightinfer.kernels.w8a16_gemm import w8a16_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="real shapes: not under the interpreter"),
]

DEV = "cuda"
BLOCK_SIZE = 16  # the engine's default KV block


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error (the metric of ``test_kernels_gpu.py``)."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


# ----------------------------------------------------------------------------- W8A16

# (name, K, N, bias) of Llama-3-8B and Qwen2.5-7B linears and LM heads. Qwen's qkv has a bias; the heads' N
# (128256, 152064) are not multiples of the 64-column tile, so the last tile is ragged.
W8_SHAPES = [
    ("llama3-8b.qkv", 4096, 6144, False), ("llama3-8b.o", 4096, 4096, False),
    ("llama3-8b.gate_up", 4096, 28672, False), ("llama3-8b.down", 14336, 4096, False),
    ("qwen2.5-7b.qkv", 3584, 4608, True), ("qwen2.5-7b.gate_up", 3584, 37888, False),
    ("qwen2.5-7b.down", 18944, 3584, False),
    ("llama3-8b.lm_head", 4096, 128256, False), ("qwen2.5-7b.lm_head", 3584, 152064, False),
]
# W8 layouts by group: 32 (Q8_0 symmetric, Q5_K with fractional zeros), 16 (Q6_K), 0 = one group spanning K
# (per-channel 8-bit GPTQ, group_size -1: W8A16Linear's group_size = in_features)
W8_GROUPS = [32, 16, 0]
W8_M = [1, 16, 128, 512]  # decode batches (the 16-row tile, M == 1 specialized) and prefill chunks (64-row tile)
W8_HEAD_M = [1, 16]  # an LM head multiplies only each sequence's last position
W8_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}  # test_kernels_gpu.py's W4 tolerances


def w8_weights(dev: str, n: int, k: int, g: int, symmetric: bool, seed: int = 0):
    """Random W8 run-time tensors: int8 codes [N, K] over the whole range, fp32 scales [K // G, N], and for the
    asymmetric layout fractional fp32 zeros (GGUF Q5_1 / Q5_K give -m / d, not integers)."""
    gen = torch.Generator(device=dev).manual_seed(seed + n + k + g)
    q = torch.randint(-128, 128, (n, k), generator=gen, device=dev, dtype=torch.int8)
    scales = torch.rand(k // g, n, generator=gen, device=dev) * 0.01 + 0.001
    zeros = None if symmetric else torch.rand(k // g, n, generator=gen, device=dev) * 20 - 10
    return q, scales, zeros


def check_w8a16(dev: str, k: int, n: int, g: int, symmetric: bool, has_bias: bool, ms: list[int],
                dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16),
                tol: dict[torch.dtype, float] | None = None) -> None:
    """``w8a16_gemm`` against ``reference.w8a16_gemm`` (fp32 dequantization and product) for every M in ``ms``
    and activation dtype; ``g == 0`` means one group over all of K. The kernel has one tiled path (no split-K,
    no deferred reduction), so the M values choose between its two tiles."""
    tol = tol or W8_TOL
    g = g or k
    q, scales, zeros = w8_weights(dev, n, k, g, symmetric)
    gen = torch.Generator(device=dev).manual_seed(1)
    for dtype in dtypes:
        bias = torch.randn(n, generator=gen, device=dev).to(dtype) if has_bias else None
        for m in ms:
            x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            got = w8a16_gemm(x, q, scales, zeros, bias)
            assert got.dtype == dtype and got.shape == (m, n)
            want = ref.w8a16_gemm(x, q, scales, zeros, bias)
            err = rel_err(got, want)
            assert err < tol[dtype], (k, n, g, symmetric, dtype, m, err)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("g", W8_GROUPS, ids=lambda g: f"g{g}" if g else "per-channel")
@pytest.mark.parametrize("name,k,n,has_bias", W8_SHAPES, ids=[s[0] for s in W8_SHAPES])
def test_w8a16_real_shapes(name: str, k: int, n: int, has_bias: bool, g: int, symmetric: bool) -> None:
    """Llama-3-8B / Qwen2.5-7B linears and LM heads, groups of 32 / 16 / per channel, with and without zeros,
    fp16 and bf16 activations, at decode and prefill M."""
    check_w8a16(DEV, k, n, g, symmetric, has_bias, W8_HEAD_M if name.endswith("lm_head") else W8_M)


def check_w8a16_codes_exact(dev: str, n: int, k: int, g: int) -> None:
    """One-hot fp16 activations pick single weights: every int8 code minus a fractional zero, times a power-of-two
    scale, comes back exactly, at the first and last column of a group and of K. The kernel decodes in fp32 and
    rounds the weight once to fp16; (q - z) * 2^-4 is a multiple of 2^-5 below 16 in magnitude, which fp16
    holds exactly, so any other rounding, a wrong group or a wrong zero shows as a changed bit."""
    rows, cols = torch.arange(n, device=dev), torch.arange(k, device=dev)
    codes = ((rows[:, None] + cols[None, :]) % 256 - 128).to(torch.int8)
    scales = torch.full((k // g, n), 2.0**-4, device=dev)
    zeros = ((rows % 7).float() * 0.5 - 1.5)[None, :].repeat(k // g, 1)  # halves: fractional, exact in fp16
    for k0 in (0, g - 1, k - 1):
        x = torch.zeros(2, k, dtype=torch.float16, device=dev)
        x[:, k0] = 1.0
        exact = ((codes[:, k0].float() - zeros[k0 // g]) * scales[k0 // g]).half()
        assert torch.equal(w8a16_gemm(x, codes, scales, zeros)[0], exact), k0
        assert torch.equal(w8a16_gemm(x, codes, scales, None)[1], (codes[:, k0].float() * 2.0**-4).half()), k0


def test_w8a16_codes_exact_on_the_gpu() -> None:
    """The whole int8 range and fractional zeros decode exactly on the GPU (groups of 16, Q6_K)."""
    check_w8a16_codes_exact(DEV, 512, 4096, 16)


# ----------------------------------------------------------------------------- window + softcap attention


@dataclass(frozen=True)
class AttnCase:
    """One model's attention layer: heads, KV heads, head_dim, sliding window (0: a global layer), softcap
    (0: none), softmax scale."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    softcap: float
    scale: float


ATTN_CASES = [
    AttnCase("gemma2-9b.local", 16, 8, 256, 4096, 50.0, 256**-0.5),
    AttnCase("gemma2-9b.global", 16, 8, 256, 0, 50.0, 256**-0.5),
    # query_pre_attn_scalar 144 with head_dim 128: the scale is not head_dim ** -0.5
    AttnCase("gemma2-27b.local", 32, 16, 128, 4096, 50.0, 144**-0.5),
    AttnCase("gemma3-4b.local", 8, 4, 256, 1024, 0.0, 256**-0.5),
    AttnCase("phi3-mini", 32, 32, 96, 2047, 0.0, 96**-0.5),  # odd window, head_dim not a power of two
    AttnCase("mistral-7b", 32, 8, 128, 4096, 0.0, 128**-0.5),
]
# (cache, activation dtype): the engine's fp16 and INT8 caches, and Gemma's default bf16
CACHES = [("fp16", torch.float16), ("int8", torch.float16), ("bf16", torch.bfloat16)]
ATTN_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def decode_contexts(window: int, span: int) -> list[int]:
    """Context lengths around a window edge and past it (two windows and a ragged block); ``span`` stands for the
    window of a global layer, where the same lengths test long contexts."""
    w = window or span
    return [1, 17, w - 1, w, w + 1, w + BLOCK_SIZE + 3, 2 * w + 37]


def prefill_chunks(window: int, span: int) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) of chunked prefills: a first chunk longer than the window, chunks whose
    prefix crosses the window edge (before, at, after it), one far past it, a single token."""
    w = window or span
    return [(0, w + w // 8), (w - w // 8, w // 4), (w - 1, 16 + w // 64), (w + 5, 16 + w // 32),
            (2 * w + 5, 16 + w // 64), (w, 1), (3, 40)]


def paged_cache(dev: str, ctx: list[int], num_kv_heads: int, head_dim: int, cache: str, dtype: torch.dtype,
                seed: int = 0) -> tuple[PagedKV, torch.Tensor, torch.Tensor]:
    """A cache allocated as the engine allocates it (``KVCacheSpec.allocate``: on a GPU the INT8 scales are
    head-major), random K/V of each sequence stored by the Triton store kernel into shuffled blocks. Returns the
    cache, the block table (int32, -1 padded) and the context lengths."""
    cache_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[cache]
    nblk = [-(-c // BLOCK_SIZE) for c in ctx]
    num_blocks = sum(nblk) + 4
    kv = KVCacheSpec(1, num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype).allocate(num_blocks, torch.device(dev))
    gen = torch.Generator(device=dev).manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    table = torch.full((len(ctx), max(nblk) + 1), -1, dtype=torch.int32, device=dev)
    used = 0
    for s, (n, nb) in enumerate(zip(ctx, nblk)):
        table[s, :nb] = perm[used:used + nb].int()
        used += nb
        pos = torch.arange(n, device=dev)
        slots = table[s, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=dev).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=dev).to(dtype)
        store_kvcache(k, v, kv, slots)
    return kv, table, torch.tensor(ctx, dtype=torch.int32, device=dev)


def drop_before(table: torch.Tensor, first_visible: list[int]) -> torch.Tensor:
    """-1 for every block wholly before each sequence's first visible key: the engine frees those blocks of a
    windowed layer, so a kernel that read one would read another sequence's data (or fault)."""
    table = table.clone()
    for i, lo in enumerate(first_visible):
        table[i, : lo // BLOCK_SIZE] = -1
    return table


def query_gain(case: AttnCase) -> float:
    """The factor on unit-normal queries that gives scaled scores a standard deviation of softcap / 2 (so that
    the cap bends them), or of 1 without a cap (as ``test_kernels_gpu.py``'s scores)."""
    unit = case.scale * case.head_dim**0.5  # std of scaled scores of unit-normal q and k
    return (case.softcap / 2 if case.softcap else 1.0) / unit


def assert_not_vacuous(case: AttnCase, want: torch.Tensor, plain: torch.Tensor, capped_only: torch.Tensor) -> None:
    """The window and the cap changed the reference's result: the comparisons are not passed by a kernel that
    ignores them. ``plain``: neither; ``capped_only``: the cap without the window."""
    if case.window:
        assert rel_err(capped_only, want) > 1e-2, "the window did not change the result"
    if case.softcap:
        assert rel_err(plain, capped_only) > 1e-2, "the soft cap did not change the result"


def check_window_decode(dev: str, case: AttnCase, cache: str, dtype: torch.dtype, ctx: list[int],
                        partition_size: int, tol: float) -> None:
    """Decode over the engine's table (blocks before the window dropped) against the reference over the whole
    table: the planned launch, a forced split into ``partition_size``-token partitions, one partition."""
    kv, table, lens = paged_cache(dev, ctx, case.num_kv_heads, case.head_dim, cache, dtype)
    gen = torch.Generator(device=dev).manual_seed(2)
    q = (torch.randn(len(ctx), case.num_heads, case.head_dim, generator=gen, device=dev) * query_gain(case)).to(dtype)
    dtable = drop_before(table, [ref.window_start(n - 1, case.window) for n in ctx])
    want = ref.paged_attention_decode(q, kv, table, lens, case.scale, case.window, case.softcap)
    whole = 64 * -(-(max(ctx) + 64) // 64)  # a multiple of every decode tile, longer than any span: one partition
    launches = {"planned": paged_attention_decode(q, kv, dtable, lens, case.scale, case.window, case.softcap)}
    for part in (partition_size, whole):
        launches[f"partition {part}"] = paged_attention_decode_impl(q, kv, dtable, lens, case.scale, case.window,
                                                                    case.softcap, partition_size=part)
    for how, got in launches.items():
        err = rel_err(got, want)
        assert err < tol, (case.name, cache, how, err)
    assert_not_vacuous(case, want, ref.paged_attention_decode(q, kv, table, lens, case.scale),
                       ref.paged_attention_decode(q, kv, table, lens, case.scale, 0, case.softcap))


def check_window_prefill(dev: str, case: AttnCase, cache: str, dtype: torch.dtype, chunks: list[tuple[int, int]],
                         tol: float) -> None:
    """Chunked prefill (new tokens already stored after a cached prefix) over the engine's table against the
    reference: chunks whose prefix crosses the window edge, a first chunk longer than the window."""
    ctx = [p + n for p, n in chunks]
    kv, table, lens = paged_cache(dev, ctx, case.num_kv_heads, case.head_dim, cache, dtype, seed=3)
    q_lens = [n for _, n in chunks]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(4)
    q = (torch.randn(sum(q_lens), case.num_heads, case.head_dim, generator=gen, device=dev)
         * query_gain(case)).to(dtype)
    dtable = drop_before(table, [ref.window_start(p, case.window) for p, _ in chunks])
    want = ref.paged_attention_prefill(q, kv, cu, lens, table, case.scale, case.window, case.softcap)
    got = paged_attention_prefill(q, kv, cu, lens, dtable, case.scale, case.window, case.softcap)
    err = rel_err(got, want)
    assert err < tol, (case.name, cache, err)
    assert_not_vacuous(case, want, ref.paged_attention_prefill(q, kv, cu, lens, table, case.scale),
                       ref.paged_attention_prefill(q, kv, cu, lens, table, case.scale, 0, case.softcap))


# bf16 only where a model runs in it by default (Gemma): one local and one global layer
ATTN_PARAMS = [pytest.param(c, cache, dt, id=f"{c.name}-{cache}") for c in ATTN_CASES for cache, dt in CACHES
               if cache != "bf16" or c.name.startswith("gemma2-9b")]


@pytest.mark.parametrize("case,cache,dtype", ATTN_PARAMS)
def test_window_softcap_decode_real_shapes(case: AttnCase, cache: str, dtype: torch.dtype) -> None:
    """Decode at contexts up to twice the window (global layers: up to 8229 tokens)."""
    check_window_decode(DEV, case, cache, dtype, decode_contexts(case.window, 4096), 512, ATTN_TOL[dtype])


@pytest.mark.parametrize("case,cache,dtype", ATTN_PARAMS)
def test_window_softcap_prefill_real_shapes(case: AttnCase, cache: str, dtype: torch.dtype) -> None:
    """Chunked prefill with cached prefixes around and past the window edge."""
    check_window_prefill(DEV, case, cache, dtype, prefill_chunks(case.window, 4096), ATTN_TOL[dtype])
