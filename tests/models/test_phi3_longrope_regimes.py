"""Phi-3 LongRoPE's two regimes against transformers (fp32, tiny random config, original length 64).

lightinfer picks the factors once per engine, from ``max_model_len`` (as vLLM and llama.cpp do; a paged,
prefix-cached engine cannot re-rotate cached keys when a sequence grows past the original length), while
transformers picks them per forward from the sequence's length:

* ``max_model_len <= original``: the short factors, equal to transformers on every sequence;
* ``max_model_len > original``: the long factors for every sequence, equal to transformers on sequences
  longer than the original length and, by design, different on shorter ones (where transformers still uses
  the short factors).
"""

from __future__ import annotations

import pytest
import torch

from lightinfer import LLM
from tests.models.arch_cases import hf_model, write_case

ORIGINAL = 64  # original_max_position_embeddings of the "phi3-longrope" case


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory):
    path = write_case(tmp_path_factory.mktemp("phi3-longrope") / "model", "phi3-longrope")
    hf = hf_model(path)
    assert hf.config.original_max_position_embeddings == ORIGINAL < hf.config.max_position_embeddings
    return path, hf


def _ids(n: int) -> list[int]:
    return torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _rel_diff(llm: LLM, hf: torch.nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = llm.llm_engine.prompt_logits(ids)
    assert ref.std() > 0.05  # not vacuous
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_short_regime_matches_transformers_on_every_length(phi3) -> None:
    path, hf = phi3
    llm = LLM(str(path), dtype="float32", max_model_len=ORIGINAL, num_kv_blocks=16, max_num_seqs=2)
    for n in (9, 40, ORIGINAL):
        assert _rel_diff(llm, hf, _ids(n)) <= 1e-4, f"{n}-token prompt, short factors"


def test_long_regime_uses_long_factors_for_every_length(phi3) -> None:
    path, hf = phi3
    llm = LLM(str(path), dtype="float32", max_model_len=4 * ORIGINAL, num_kv_blocks=32, max_num_seqs=2)
    for n in (ORIGINAL + 1, 150):  # past the original length: transformers uses the long factors too
        assert _rel_diff(llm, hf, _ids(n)) <= 1e-4, f"{n}-token prompt, long factors"
    # shorter sequences: transformers switches back to the short factors, this engine does not (documented)
    assert _rel_diff(llm, hf, _ids(40)) > 1e-3  # ten times the tolerance of equality
    # ...and what it computes there is transformers' long-factor rotation: make transformers use its long
    # inverse frequencies for short sequences too (it keeps them apart from the short ones it switches back to)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=ORIGINAL + 1)
    rotary = hf.model.rotary_emb
    short_inv_freq = rotary.original_inv_freq
    assert not torch.allclose(long_inv_freq, short_inv_freq)
    rotary.original_inv_freq = long_inv_freq
    try:
        assert _rel_diff(llm, hf, _ids(40)) <= 1e-4
    finally:
        rotary.original_inv_freq = short_inv_freq
