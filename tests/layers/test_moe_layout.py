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

# name -> (quant config, expert intermediate size, the CPU forms kernels/moe_cpu.py prepares with bf16 activations)
COPY_CASES = {
    "all W4": (_config({}), I, ("int4", "int4")),
    # gate/up N = 2 x 36 = 72, not a multiple of 16: torch's int4 kernel cannot take it, dense fallback
    "N not a multiple of 16": (_config({f"{PREFIX}.{e}.down_proj": W8 for e in range(E)}), 36, ("dense", "dense")),
    "group 16": (_config({}, default=W4_16), I, ("dense", "dense")),
    "dense model": (None, I, ("dense", "dense")),
}


@pytest.mark.parametrize("case", sorted(COPY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_estimated_cpu_copy_is_what_the_cpu_preparation_holds(case: str, dtype: torch.dtype) -> None:
    """``experts_nbytes``' copy (and ``FusedMoE.cpu_copy_nbytes``, on the stacks' shapes) equals the bytes the
    CPU preparation really holds (``prepared_nbytes``): int4 codes plus their scale/offset pairs, the dense
    fallbacks, oneDNN's fp32 prepack, nothing for dense 16-bit stacks."""
    from lightinfer.kernels.moe_cpu import int4_gemm_available, onednn_available

    qc, inter, kinds = COPY_CASES[case]
    moe = make_experts(E, H, inter, dtype, qc, PREFIX)
    gen = torch.Generator().manual_seed(0)
    for t in (*moe.parameters(), *moe.buffers()):  # any finite values: the preparation's sizes do not depend on them
        t.copy_(torch.randint(0, 2**16, t.shape, generator=gen, dtype=torch.int32) if t.dtype == torch.int32
                else torch.rand(t.shape, generator=gen).to(t.dtype))
    _, estimate = experts_nbytes(E, H, inter, dtype, qc, PREFIX)
    assert moe.prepared_nbytes() == 0
    moe.pack_for_cpu()
    if dtype == torch.float32 and onednn_available():
        kinds = ("onednn", "onednn")
    elif not int4_gemm_available():
        kinds = ("dense", "dense")
    assert tuple(p.kind for p in moe._prepared) == kinds  # the case reaches the form it is meant to
    assert estimate == moe.prepared_nbytes()
    assert moe.cpu_copy_nbytes() == estimate  # the same rule on the built stacks' shapes
    if qc is None and dtype != torch.float32:
        assert estimate == 0  # dense 16-bit experts compute with their own stacks
