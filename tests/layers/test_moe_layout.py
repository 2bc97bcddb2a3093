"""One decision for how a MoE layer's expert stacks are stored (``layers/moe.py``: ``expert_group_sizes``):
``make_experts`` builds by it and ``experts_nbytes`` counts by it, so the estimate cannot drift from the
module (it once judged every expert by expert 0)."""

from __future__ import annotations

import pytest
import torch

from lightinfer.formats.scheme import LINEAR_FORMATS_KEY, LinearFormat
from lightinfer.layers.moe import expert_group_sizes, experts_nbytes, make_experts

E, H, I = 4, 64, 32  # experts, hidden, expert intermediate (gate/up K = H, down K = I)
PREFIX = "model.layers.0.mlp.experts"
W4_32 = LinearFormat("w4", 32, source="GGUF Q4_0")
W4_64 = LinearFormat("w4", 64, source="GGUF Q4_0")
W8 = LinearFormat("w8", 32, symmetric=True, source="GGUF Q8_0")


def _config(fmt_of: dict[str, LinearFormat], default: LinearFormat = W4_32) -> dict:
    """A per-module format map (as a Checkpoint makes): every expert projection ``default`` unless named."""
    names = [f"{PREFIX}.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")]
    return {"quant_method": "gguf", LINEAR_FORMATS_KEY: {n: fmt_of.get(n, default) for n in names}}


def _module_bytes(m: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))


CASES = {
    "all W4": (_config({}), (32, 32)),
    "down stack 8-bit": (_config({f"{PREFIX}.{e}.down_proj": W8 for e in range(E)}), (32, None)),
    # expert 0 is W4 but expert 2's up projection is 8-bit: the whole gate/up stack is dense
    "one expert 8-bit": (_config({f"{PREFIX}.2.up_proj": W8}), (None, 32)),
    "dense model": (None, (None, None)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_counts_the_stacks_make_experts_builds(case: str, dtype: torch.dtype) -> None:
    qc, groups = CASES[case]
    assert expert_group_sizes(E, H, I, qc, PREFIX) == groups
    moe = make_experts(E, H, I, dtype, qc, PREFIX)
    assert (moe.group_size or None, moe.down_group_size or None) == groups
    stored, _ = experts_nbytes(E, H, I, dtype, qc, PREFIX)
    assert stored == _module_bytes(moe)


def test_mixed_group_sizes_are_refused_by_both() -> None:
    qc = _config({f"{PREFIX}.3.gate_proj": W4_64})
    for build in (make_experts, experts_nbytes):
        with pytest.raises(ValueError, match=r"gate_proj/up_proj projections are 4-bit with several group sizes"):
            build(E, H, I, torch.float32, qc, PREFIX)


W4_16 = LinearFormat("w4", 16, source="GGUF Q4_0")  # a group torch's int4 kernel lacks (it takes 32..256)

# name -> (quant config, expert intermediate size, the CPU forms kernels/moe_cpu.py prepares with bf16 activations
# on torch's kernels, and where the C 4-bit product serves)
COPY_CASES = {
    "all W4": (_config({}), I, ("int4", "int4"), ("c", "c")),
    # gate/up N = 2 x 36 = 72, not a multiple of 16: torch's int4 kernel cannot take it, dense fallback (the C
    # product takes any N); the 8-bit down projection is dense either way
    "N not a multiple of 16": (_config({f"{PREFIX}.{e}.down_proj": W8 for e in range(E)}), 36, ("dense", "dense"),
                               ("c", "dense")),
    "group 16": (_config({}, default=W4_16), I, ("dense", "dense"), ("dense", "dense")),
    "dense model": (None, I, ("dense", "dense"), ("dense", "dense")),
}


@pytest.mark.parametrize("case", sorted(COPY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_estimated_cpu_copy_is_what_the_cpu_preparation_adds(case: str, dtype: torch.dtype) -> None:
    """``experts_nbytes``' copy (and ``FusedMoE.cpu_copy_nbytes``, on the stacks' shapes) equals what the CPU
    preparation really adds (``cpu_added_nbytes``: the copies' bytes less the W4 stacks it releases to the meta
    device): 0 for int4 codes plus their scale/offset pairs, the dense fallbacks' and oneDNN's fp32 prepack's
    size less the W4 stack, nothing for dense 16-bit stacks; ``stored + copy`` is what the layer then holds."""
    from lightinfer.kernels.moe_cpu import c_product_available, int4_gemm_available, onednn_available

    qc, inter, kinds, kinds_c = COPY_CASES[case]
    moe = make_experts(E, H, inter, dtype, qc, PREFIX)
    gen = torch.Generator().manual_seed(0)
    for t in (*moe.parameters(), *moe.buffers()):  # any finite values: the preparation's sizes do not depend on them
        t.copy_(torch.randint(0, 2**16, t.shape, generator=gen, dtype=torch.int32) if t.dtype == torch.int32
                else torch.rand(t.shape, generator=gen).to(t.dtype))
    stored, estimate = experts_nbytes(E, H, inter, dtype, qc, PREFIX)
    assert moe.prepared_nbytes() == 0 and moe.cpu_copy_nbytes() == estimate
    moe.pack_for_cpu()
    if dtype == torch.float32 and onednn_available():
        kinds = ("onednn", "onednn")
    elif dtype != torch.float32 and c_product_available():
        kinds = kinds_c
    elif not int4_gemm_available():
        kinds = ("dense", "dense")
    assert tuple(p.kind for p in moe._prepared) == kinds  # the case reaches the form it is meant to
    assert estimate == moe.cpu_added_nbytes()
    assert moe.cpu_copy_nbytes() == estimate  # the same rule on the (released) stacks' shapes
    w4 = [s for s in moe.STACKS if moe.is_quantized(s)]
    assert moe.released == bool(w4) and moe.device.type == "cpu"
    assert all(getattr(moe, f"{s}_{p}").is_meta for s in w4 for p in ("qweight", "scales", "zeros"))
    held = sum(t.numel() * t.element_size() for t in (*moe.parameters(), *moe.buffers()) if not t.is_meta)
    assert held + moe.prepared_nbytes() == stored + estimate  # the layer holds the estimate, once
    if kinds in (("int4", "int4"), ("c", "c")):
        assert estimate == 0  # the same codes and a scale/offset pair per group: the stacks' size
    if qc is None and dtype != torch.float32:
        assert estimate == 0  # dense 16-bit experts compute with their own stacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_layer_released_stacks_compute_through_the_cpu_copy(dtype: torch.dtype) -> None:
    """A ``--cpu-experts`` layer (built in host memory) after ``pack_for_cpu`` (what a GPU engine's
    ``prepare_host_experts`` calls): its W4 stacks on meta, the device still the CPU, and it computes through the
    torch_cpu copy whatever backend the rest of the model is forced to, as the reference kernel on the stacks."""
    from lightinfer.kernels import get_backend
    from lightinfer.layers.moe import experts_in_host_memory
    from lightinfer.layers.ops import use_backend

    with experts_in_host_memory({0}):
        moe = make_experts(E, H, 2 * I, dtype, _config({}), PREFIX, layer_idx=0)
    assert moe.on_host
    gen = torch.Generator().manual_seed(0)
    moe.w13_qweight.copy_(torch.randint(-2**31, 2**31 - 1, moe.w13_qweight.shape, generator=gen, dtype=torch.int32))
    moe.w2_qweight.copy_(torch.randint(-2**31, 2**31 - 1, moe.w2_qweight.shape, generator=gen, dtype=torch.int32))
    for t in (moe.w13_scales, moe.w2_scales):
        t.copy_((torch.rand(t.shape, generator=gen) * 0.02).to(dtype))
    for t in (moe.w13_zeros, moe.w2_zeros):
        t.copy_(torch.randint(0, 16, t.shape, generator=gen).to(dtype))
    x = torch.randn(5, H, generator=gen).to(dtype)
    weights, ids = torch.full((5, 2), 0.5), torch.randint(0, E, (5, 2), generator=gen)
    want = get_backend("reference").fused_moe(x, *moe.expert_weights(), weights, ids)  # from the stacks
    stacks = _module_bytes(moe)
    moe.pack_for_cpu()
    assert moe.released and moe.device.type == "cpu" and moe.released_nbytes() == stacks
    assert _module_bytes(moe) == stacks  # by shape: the estimates and check_moe_args still see the stacks
    assert all(t.is_meta for t in moe.buffers())
    with use_backend("reference"):
        got = moe(x, weights, ids)
    scale = float(want.abs().max())
    assert scale > 0
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=(1e-5 if dtype == torch.float32 else 2e-2) * scale)
