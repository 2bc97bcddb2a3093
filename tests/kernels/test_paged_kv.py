"""KVCacheSpec and PagedKV: allocation layout, the checks made once at construction, block copies."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import KVCacheSpec, PagedKV


def test_kv_cache_is_one_allocation_per_kind() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.int8)
    layers = spec.allocate_layers(3, 5, torch.device("cpu"))
    assert len(layers) == 3 and set(layers[0].named_tensors()) == {"k", "v", "k_scale", "k_zero", "v_scale", "v_zero"}
    for name in layers[0].named_tensors():
        views = [t.named_tensors()[name] for t in layers]
        assert all(v.is_contiguous() and v.shape[0] == 5 for v in views)
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one tensor underneath
        assert len({v.data_ptr() for v in views}) == 3  # disjoint layer slices
    layers[1].k.fill_(7)
    assert layers[0].k.abs().sum() == 0 and layers[2].k.abs().sum() == 0


def test_properties_and_bytes() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=8, dtype=torch.int8)
    kv = spec.allocate(4, torch.device("cpu"))
    assert (kv.is_int8, kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim) == (True, 4, 8, 3, 64)
    assert kv.k_scale.shape == (4, 8, 3) and kv.k_scale.dtype == torch.float16
    # K and V codes plus an fp16 scale and zero per token and head, over both layers
    assert spec.bytes_per_token == 2 * 2 * 3 * (64 + 4)
    fp16 = KVCacheSpec(2, 3, 64, 8, torch.float16).allocate(4, torch.device("cpu"))
    assert not fp16.is_int8 and fp16.scales == (None,) * 4 and set(fp16.named_tensors()) == {"k", "v"}


def test_head_major_scales_on_cuda_layout() -> None:
    """On CUDA the scale/zero tensors are head-major ``[blocks, block_size, heads]`` views; PagedKV accepts
    any strides the four share (checked here on CPU tensors made the same way)."""
    hm = [torch.zeros(4, 3, 8, dtype=torch.float16).transpose(1, 2) for _ in range(4)]
    kv = PagedKV(torch.zeros(4, 8, 3, 16, dtype=torch.int8), torch.zeros(4, 8, 3, 16, dtype=torch.int8), *hm)
    assert kv.k_scale.stride() == (24, 1, 8)


@pytest.mark.parametrize("case,needle", [
    ("v_shape", "equal strides"),
    ("k_dtype", "one dtype"),
    ("int16", "not in fp16/bf16/fp32/int8"),
    ("missing_scale", "needs float16"),
    ("fp32_scale", "needs float16"),
    ("mixed_strides", "same strides"),
    ("scales_on_float", "takes no scales"),
    ("head_dim_stride", "stride 1 on head_dim"),
])
def test_bad_layouts_are_clear_errors(case: str, needle: str) -> None:
    k = torch.zeros(2, 4, 2, 16, dtype=torch.int8)
    v = torch.zeros_like(k)
    scales = [torch.zeros(2, 4, 2, dtype=torch.float16) for _ in range(4)]
    if case == "v_shape":
        v = torch.zeros(2, 4, 2, 8, dtype=torch.int8)
    elif case == "k_dtype":
        k = k.half()
    elif case == "int16":
        k, v = k.to(torch.int16), v.to(torch.int16)
    elif case == "missing_scale":
        scales[3] = None
    elif case == "fp32_scale":
        scales[1] = scales[1].float()
    elif case == "mixed_strides":
        scales[0] = torch.zeros(2, 2, 4, dtype=torch.float16).transpose(1, 2)
    elif case == "scales_on_float":
        k, v = k.half(), v.half()
    elif case == "head_dim_stride":
        k = torch.zeros(2, 4, 16, 2, dtype=torch.int8).transpose(2, 3)
        v = torch.zeros(2, 4, 16, 2, dtype=torch.int8).transpose(2, 3)
    with pytest.raises(ValueError, match=needle):
        PagedKV(k, v, *scales)


def test_copy_blocks_copies_every_tensor() -> None:
    kv = KVCacheSpec(1, 2, 8, 4, torch.int8).allocate(6, torch.device("cpu"))
    for i, t in enumerate(kv.tensors()):
        t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype) + i)
    before = [t.clone() for t in kv.tensors()]
    kv.copy_blocks(torch.tensor([1, 4]), torch.tensor([3, 0]))
    for old, new in zip(before, kv.tensors()):
        assert torch.equal(new[3], old[1]) and torch.equal(new[0], old[4])
        assert torch.equal(new[[1, 2, 4, 5]], old[[1, 2, 4, 5]])
