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
