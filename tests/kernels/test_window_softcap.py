"""Sliding-window and soft-capped attention, GeGLU and partial rotary: the reference against first
principles, then ``torch_cpu`` and the Triton kernels (interpreter) against the reference. Block-table
entries of blocks wholly before every window are -1 here, as the engine leaves them once it freed those
blocks: a kernel that read one would fail or return garbage."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import PagedKV, SplitKPartials, torch_cpu
from lightinfer.kernels import reference as ref
from lightinfer.kernels.norm_rope import gelu_tanh_and_mul, rotary_qk
from lightinfer.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_impl,
    paged_attention_prefill,
)
from lightinfer.kernels.sdpa import varlen_causal_attention
from tests.kernels.test_triton_paged_attention import TOL, _cache


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pos: torch.Tensor, window: int,
              softcap: float) -> torch.Tensor:
    """The definition (transformers' eager attention with a sliding-window mask): q ``[Lq, H, D]`` at absolute
    positions ``pos``, keys at positions 0.."""
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    j = torch.arange(k.shape[0])[None, :]
    ok = (j <= pos[:, None]) & ((j > pos[:, None] - window) if window else True)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~ok, float("-inf")), -1), vf)


def _drop_before_window(table: torch.Tensor, first_visible: list[int], block_size: int) -> torch.Tensor:
    """-1 for every block wholly before each sequence's first visible key (what the engine frees)."""
    table = table.clone()
    for i, lo in enumerate(first_visible):
        table[i, : lo // block_size] = -1
    return table


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (0, 4.0), (7, 2.5)])
def test_reference_matches_the_definition(window: int, softcap: float) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 4, 8, generator=gen) * 3, torch.randn(20, 2, 8, generator=gen),
               torch.randn(20, 2, 8, generator=gen))
    got = ref.attend(q, k, v, 0.4, causal_offset=11, window=window, softcap=softcap)
    torch.testing.assert_close(got, _explicit(q, k, v, 0.4, torch.arange(11, 20), window, softcap))
    varlen = ref.varlen_causal_attention(q, k[:9], v[:9], torch.tensor([0, 9], dtype=torch.int32), 0.4, window, softcap)
    torch.testing.assert_close(varlen, _explicit(q, k[:9], v[:9], 0.4, torch.arange(9), window, softcap))


@pytest.mark.parametrize("window,softcap", [(6, 0.0), (13, 3.0), (0, 3.0)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_torch_cpu_matches_reference(window: int, softcap: float, cache_dtype: torch.dtype) -> None:
    ctx, block_size = [3, 20, 37, 9], 4
    kc, vc, table, lens, aux = _cache(ctx, 2, 8, block_size, cache_dtype, torch.float32, seed=3)
    kv = PagedKV(kc, vc, *aux)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(ctx), 6, 8, generator=gen) * 2
    dtable = _drop_before_window(table, [max(0, n - window) if window else 0 for n in ctx], block_size)
    want = ref.paged_attention_decode(q, kv, table, lens, 0.3, window, softcap)
    torch.testing.assert_close(torch_cpu.paged_attention_decode(q, kv, dtable, lens, 0.3, window, softcap), want,
                               atol=1e-5, rtol=1e-5)
    q_lens = [2, 11, 5, 9]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(sum(q_lens), 6, 8, generator=gen)
    first = [max(0, n - q - window + 1) if window else 0 for n, q in zip(ctx, q_lens)]
    want = ref.paged_attention_prefill(qp, kv, cu, lens, table, 0.3, window, softcap)
    got = torch_cpu.paged_attention_prefill(qp, kv, cu, lens, _drop_before_window(table, first, block_size), 0.3,
                                            window, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    kk, vv = torch.randn(sum(q_lens), 2, 8, generator=gen), torch.randn(sum(q_lens), 2, 8, generator=gen)
    torch.testing.assert_close(varlen_causal_attention(qp, kk, vv, cu, 0.3, window, softcap),
                               ref.varlen_causal_attention(qp, kk, vv, cu, 0.3, window, softcap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype,dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                               (torch.int8, torch.float16)])
@pytest.mark.parametrize("window,softcap", [(40, 0.0), (70, 20.0), (0, 20.0)])
def test_triton_decode_and_prefill_match_reference(cache_dtype: torch.dtype, dtype: torch.dtype, window: int,
                                                   softcap: float) -> None:
    ctx, q_lens, block_size = [1, 39, 100, 230], [1, 20, 70, 3], 16
    kc, vc, table, lens, aux = _cache(ctx, 2, 32, block_size, cache_dtype, dtype, seed=window)
    kv = PagedKV(kc, vc, *aux)
    gen = torch.Generator().manual_seed(2)
    scale = 32**-0.5 * 4  # sharper scores, so that the cap bends them
    q = (torch.randn(len(ctx), 8, 32, generator=gen)).to(dtype)
    dtable = _drop_before_window(table, [max(0, n - window) if window else 0 for n in ctx], block_size)
    want = ref.paged_attention_decode(q, kv, table, lens, scale, window, softcap)
    got = paged_attention_decode(q, kv, dtable, lens, scale, window, softcap)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    split = paged_attention_decode_impl(q, kv, dtable, lens, scale, window, softcap, partition_size=64)
    torch.testing.assert_close(split.float(), want.float(), **TOL[dtype])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(sum(q_lens), 8, 32, generator=gen).to(dtype)
    first = [max(0, n - q - window + 1) if window else 0 for n, q in zip(ctx, q_lens)]
    want = ref.paged_attention_prefill(qp, kv, cu, lens, table, scale, window, softcap)
    got = paged_attention_prefill(qp, kv, cu, lens, _drop_before_window(table, first, block_size), scale, window,
                                  softcap)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    if softcap:  # the cap changed the result: the comparison above is not vacuous
        plain = ref.paged_attention_prefill(qp, kv, cu, lens, table, scale, window)
        assert (plain.float() - want.float()).abs().max() > 1e-2


def test_window_and_softcap_arguments_are_checked() -> None:
    kc, vc, table, lens, _aux = _cache([4], 1, 16, 16, torch.float32, torch.float32)
    q = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="window"):
        paged_attention_decode(q, PagedKV(kc, vc), table, lens, 1.0, window=-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 2 * 1100, generator=gen) * 4).to(dtype)
    want = torch.nn.functional.gelu(x[:, :1100].float(), approximate="tanh") * x[:, 1100:].float()
    torch.testing.assert_close(ref.gelu_tanh_and_mul(x).float(), want, **TOL[dtype])
    torch.testing.assert_close(torch_cpu.gelu_tanh_and_mul(x).float(), want, **TOL[dtype])
    torch.testing.assert_close(gelu_tanh_and_mul(x).float(), want, **TOL[dtype])
    partials = torch.randn(3, 3, 64, generator=gen)  # three split-K partial sums of a [3, 64] output
    got = gelu_tanh_and_mul(SplitKPartials(partials, None, dtype))
    torch.testing.assert_close(got.float(), ref.gelu_tanh_and_mul(partials.sum(0).to(dtype)).float(), **TOL[dtype])


def test_partial_rotary() -> None:
    """Phi-4-mini style: 3/4 of each head rotates (transformers' apply_rotary_pos_emb on q[..., :R]), the rest
    passes; Triton and torch_cpu give the reference's result."""
    gen = torch.Generator().manual_seed(0)
    t, d, r = 5, 16, 12
    q, k = torch.randn(t, 4, d, generator=gen), torch.randn(t, 2, d, generator=gen)
    freqs = torch.outer(torch.arange(30.0), 1.0 / 100 ** (torch.arange(0, r, 2) / r))
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.tensor([0, 3, 7, 29, 11])
    c, s = torch.cat([cos, cos], -1)[pos][:, None], torch.cat([sin, sin], -1)[pos][:, None]

    def hf(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :r], x[..., r:]
        half = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], -1)
        return torch.cat([rot * c + half * s, rest], -1)

    want_q, want_k = ref.rotary_qk(pos, q, k, cos, sin)
    torch.testing.assert_close(want_q, hf(q))
    torch.testing.assert_close(want_k, hf(k))
    got_q, got_k = rotary_qk(pos, q, k, cos.contiguous(), sin.contiguous())
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
