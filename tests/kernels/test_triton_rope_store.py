"""rope_store_kvcache (qkv reduce + RoPE + KV store in one launch) against its reference twin,
which is the unfused sequence, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import PagedKV, SplitKPartials
from lightinfer.kernels import reference as ref
from lightinfer.kernels.rope_store import rope_store_kvcache


def _tables(d: int, max_pos: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    return freqs.cos(), freqs.sin()


def _caches(int8: bool, num_blocks: int, block_size: int, hk: int, d: int) -> list:
    dt = torch.int8 if int8 else torch.float16
    kc = torch.zeros(num_blocks, block_size, hk, d, dtype=dt)
    aux = [torch.zeros(num_blocks, block_size, hk, dtype=torch.float16) for _ in range(4)] if int8 else [None] * 4
    return [kc, kc.clone(), *aux]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("hq,hk,d", [(4, 1, 64), (6, 2, 48)])
def test_matches_the_unfused_sequence_bit_for_bit(int8: bool, split: bool, hq: int, hk: int, d: int) -> None:
    gen = torch.Generator().manual_seed(hq + d)
    t, width = 5, (hq + 2 * hk) * d
    if split:  # a W4A16 GEMM's unreduced output, with a bias (Qwen2's qkv)
        qkv = SplitKPartials(torch.randn(3, t, width, generator=gen), torch.randn(width, generator=gen).half(),
                             torch.float16)
    else:
        qkv = torch.randn(t, width, generator=gen).half()
    positions = torch.tensor([0, 7, 3, 63, 12])
    slots = torch.tensor([5, -1, 0, 17, 30])  # -1: padding, not cached (its q is still computed)
    cos, sin = _tables(d)
    want_cache, got_cache = _caches(int8, 4, 8, hk, d), _caches(int8, 4, 8, hk, d)
    want = ref.rope_store_kvcache(positions, qkv, hq, hk, cos, sin, PagedKV(*want_cache), slots)
    got = rope_store_kvcache(positions, qkv, hq, hk, cos, sin, PagedKV(*got_cache), slots)
    assert got.shape == (t, hq, d) and got.dtype == torch.float16
    assert torch.equal(got, want)
    for a, b in zip(got_cache, want_cache):
        if a is not None:
            assert torch.equal(a, b)
    assert want_cache[0].view(-1, hk, d)[[5, 0, 17, 30]].abs().sum(dim=(1, 2)).gt(0).all()  # written
    assert want_cache[0].view(-1, hk, d)[1].abs().sum() == 0  # padding left nothing


def test_rejects_a_qkv_of_the_wrong_width() -> None:
    cos, sin = _tables(64)
    kc, vc, *_ = _caches(False, 2, 8, 1, 64)
    with pytest.raises(ValueError, match=r"qkv must be float \[T, 384\]"):
        rope_store_kvcache(torch.zeros(2, dtype=torch.long), torch.zeros(2, 320).half(), 4, 1, cos, sin,
                           PagedKV(kc, vc), torch.zeros(2, dtype=torch.long))
