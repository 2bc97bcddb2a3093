"""KV-cache store kernel against ``reference.store_kvcache`` (bit-exact) under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import PagedKV
from lightinfer.kernels import reference as ref
from lightinfer.kernels.kv_store import store_kvcache


def _run(fn, key, value, cache_dtype, num_blocks, block_size, slots):
    _, h, d = key.shape
    kc = torch.zeros(num_blocks, block_size, h, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    aux = [torch.zeros(num_blocks, block_size, h, dtype=torch.float16) for _ in range(4)] \
        if cache_dtype == torch.int8 else [None] * 4
    fn(key, value, PagedKV(kc, vc, *aux), slots)
    return kc, vc, aux


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads,head_dim,block_size", [(3, 72, 16), (1, 64, 8), (8, 32, 1)])
def test_store_matches_reference(cache_dtype: torch.dtype, heads: int, head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(heads)
    num_blocks = 12
    t = 7
    key = torch.randn(t, heads, head_dim, generator=gen)
    value = torch.randn(t, heads, head_dim, generator=gen) * 3
    key[2, 0] = 0.25  # constant row: scale 1
    value[4, -1, :5] = 1e4  # outlier row
    slots = torch.tensor([0, block_size + 1, -1, 3 * block_size - 1, num_blocks * block_size - 1, 2, -1])
    if cache_dtype == torch.int8:
        key, value = key.half(), value.half()
    elif cache_dtype == torch.bfloat16:
        # the interpreter truncates fp32 -> bf16 (GPUs round to nearest): store bf16 as is
        key, value = key.bfloat16(), value.bfloat16()
    want = _run(ref.store_kvcache, key, value, cache_dtype, num_blocks, block_size, slots)
    got = _run(store_kvcache, key, value, cache_dtype, num_blocks, block_size, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        assert (a is None and b is None) or torch.equal(a, b)


def test_padding_only_and_empty_write_nothing() -> None:
    key = torch.randn(3, 2, 16)
    kc, vc, _ = _run(store_kvcache, key, key, torch.float16, 4, 4, torch.full((3,), -1))
    assert not kc.any() and not vc.any()
    kc, _, _ = _run(store_kvcache, key[:0], key[:0], torch.float16, 4, 4, torch.empty(0, dtype=torch.int64))
    assert not kc.any()


def test_int8_round_trip_error_bound_and_strided_input() -> None:
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(9, 3, 4, 64, generator=gen).half()  # [tokens, q/k/v, heads, head_dim]
    key, value = qkv[:, 1], qkv[:, 2]  # strided views, as sliced from a fused qkv projection
    slots = torch.arange(9, dtype=torch.int32) * 2
    kc, _vc, (ks, kz, _vs, _vz) = _run(store_kvcache, key, value, torch.int8, 4, 8, slots)
    back = ref.gather_kv(PagedKV(kc, _vc, ks, kz, _vs, _vz), torch.arange(4), 18, torch.float32)[0][slots.long()]
    # half a quantization step, plus the fp16 rounding of zero (|zero| <= max|x|, 2^-11 relative)
    bound = ks.view(-1, 4)[slots.long()].float().unsqueeze(-1) / 2 + key.float().abs().amax(-1, True) * 2**-10
    assert ((back - key.float()).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("case", ["shape", "aux_missing", "aux_dtype", "slot_dtype", "cache_dtype"])
def test_validation_errors(case: str) -> None:
    key = torch.randn(2, 2, 16)
    value = key.clone()
    slots = torch.tensor([0, 1])
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.int8 if case.startswith("aux") else torch.float16)
    vc = torch.zeros_like(kc)
    aux = [torch.zeros(2, 4, 2, dtype=torch.float16) for _ in range(4)]
    if case == "shape":
        value = torch.randn(2, 2, 8)
    elif case == "aux_missing":
        aux[2] = None
    elif case == "aux_dtype":
        aux[0] = aux[0].float()
    elif case == "slot_dtype":
        slots = slots.float()
    elif case == "cache_dtype":
        kc, vc = kc.to(torch.int16), vc.to(torch.int16)
    if kc.dtype != torch.int8:
        aux = [None] * 4  # a float cache has no scales
    with pytest.raises(ValueError):
        store_kvcache(key, value, PagedKV(kc, vc, *aux), slots)


def test_head_major_scales_store_identically() -> None:
    """The engine's GPU layout of the scale/zero tensors (head-major strides): same values written."""
    gen = torch.Generator().manual_seed(9)
    key = torch.randn(5, 4, 32, generator=gen).half()
    value = torch.randn(5, 4, 32, generator=gen).half()
    slots = torch.tensor([0, 17, -1, 40, 63])
    kc, vc, aux = _run(store_kvcache, key, value, torch.int8, 4, 16, slots)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    hm = [torch.zeros(4, 4, 16, dtype=torch.float16).transpose(1, 2) for _ in range(4)]
    store_kvcache(key, value, PagedKV(kc2, vc2, *hm), slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert all(torch.equal(a, b) for a, b in zip(aux, hm))
