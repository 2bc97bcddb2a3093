"""Gemma 2/3, Phi-3/Phi-4-mini, sliding windows and RoPE scalings against transformers (fp32), through the
engine: paged KV cache, chunked prefill, batched decode of prompts of different lengths, prefix caching."""

from __future__ import annotations

import pytest
import torch

from lightinfer import LLM, SamplingParams
from tests.models.arch_cases import CASES, hf_greedy, hf_model, prompts, write_case

STEPS = 32


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    path = write_case(tmp_path_factory.mktemp(name) / "model", name)
    # 64-token step budget: the longest prompt is prefilled in 3 chunks
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=64, num_kv_blocks=64, max_num_seqs=4)
    return name, hf_model(path), llm


def test_prefill_logits_match(case) -> None:
    name, hf, llm = case
    ids = prompts(name)[-1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = llm.llm_engine.prompt_logits(ids)
    assert ours.shape == ref.shape
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"{name}: max |logits diff| / max |logits| = {rel:.2e}"
    assert ref.std() > 0.05  # the check above would be vacuous on near-constant logits


def test_batched_greedy_decode_with_prefix_caching_matches(case) -> None:
    name, hf, llm = case
    if len(prompts(name)) < 2:
        pytest.skip("prefill-only case (see arch_cases.CASES)")
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    ps = prompts(name)
    first = llm.generate([ps[-1]], greedy, use_tqdm=False)[0]
    # a second batch: the first prompt extended (its blocks now cached, also those past the windows), and the
    # other prompts; every sequence is decoded through the paged cache with the others
    batch = [ps[-1] + first.outputs[0].token_ids[:5], *ps[:-1]]
    outs = llm.generate(batch, greedy, use_tqdm=False)
    assert outs[0].num_cached_tokens >= 128, "the shared prefix was not served from the prefix cache"
    assert first.outputs[0].token_ids == hf_greedy(hf, ps[-1], STEPS)
    for ids, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, STEPS), f"{name}: prompt of {len(ids)} tokens"
