"""The torch_cpu backend's few-call per-layer ops (kernels/cpu_fused.py) in bf16, as the CPU low-bit engine runs
them, against the reference backend; and the per-step memo they share."""

from __future__ import annotations

import torch

from lightinfer.kernels import PagedKV, torch_cpu
from lightinfer.kernels import reference as ref
from lightinfer.kernels.step_memo import StepMemo


def test_norms_in_bf16_round_as_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 576, generator=gen) * 3).bfloat16()
    r = torch.randn(33, 576, generator=gen).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    got, want = torch_cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    # fp32 inside both; at most one bf16 rounding step apart, almost always equal
    assert (got == want).float().mean() > 0.999
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    (n1, r1), (n2, r2) = torch_cpu.fused_add_rms_norm(x, r, w, 1e-5), ref.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(r1, r2) and r1.dtype == torch.bfloat16
    torch.testing.assert_close(n1.float(), n2.float(), rtol=1e-2, atol=1e-2)


def test_rope_store_and_silu_in_bf16_are_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    d, hq, hk, t = 64, 9, 3, 5
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).bfloat16()
    positions = torch.tensor([0, 7, 31, 2, 100])
    slots = torch.tensor([3, 9, 17, 0, 30])
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))

    def cache() -> PagedKV:
        return PagedKV(torch.zeros(4, 8, hk, d, dtype=torch.bfloat16), torch.zeros(4, 8, hk, d, dtype=torch.bfloat16))

    a, b = cache(), cache()
    qa = torch_cpu.rope_store_kvcache(positions, qkv, hq, hk, freqs.cos(), freqs.sin(), a, slots)
    qb = ref.rope_store_kvcache(positions, qkv, hq, hk, freqs.cos(), freqs.sin(), b, slots)
    assert qa.dtype == torch.bfloat16 and torch.equal(qa, qb)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    gate_up = torch.randn(6, 2 * 1536, generator=gen).bfloat16()
    assert torch.equal(torch_cpu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))


def test_step_memo_rebuilds_for_new_or_modified_tensors() -> None:
    memo, builds = StepMemo(), []

    def build() -> int:
        builds.append(1)
        return len(builds)

    a = torch.arange(4)
    assert memo.get("k", (a,), (), build) == 1
    assert memo.get("k", (a,), (), build) == 1  # same tensor, unmodified: reused
    a[0] = 9  # in place: its version counter moves
    assert memo.get("k", (a,), (), build) == 2
    assert memo.get("k", (a.clone(),), (), build) == 3  # another tensor
    assert memo.get("k", (a,), ("other",), build) == 4  # other extra values
