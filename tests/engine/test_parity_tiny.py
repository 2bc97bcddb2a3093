"""Logits parity against transformers on tiny random-weight models of every architecture."""

from __future__ import annotations

import pytest
import torch

from lightinfer import LLM
from tests.conftest import write_tiny_checkpoint

CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-mha-tied": ("LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope-scaling": ("LlamaForCausalLM", {
        "num_key_value_heads": 1, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"head_dim": 32}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case: str) -> None:
    import transformers

    arch, overrides = CASES[case]
    path = write_tiny_checkpoint(tmp_path / case, arch, **overrides)
    hf = getattr(transformers, arch).from_pretrained(path, torch_dtype=torch.float32).eval()
    # 150 tokens: crosses block boundaries and, with a 64-token batch budget, is computed in 3 chunks
    ids = torch.randint(0, 258, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=64, num_kv_blocks=32)
    ours = llm.llm_engine.prompt_logits(ids)
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4, f"{case}: max |logits diff| {diff:.2e}"
    assert ref.std() > 0.1  # the check above would be vacuous on near-constant logits


def test_decode_steps_match_prefill_logits(tmp_path) -> None:
    """Greedy decoding through the paged cache picks what a full re-prefill would."""
    path = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    from lightinfer import SamplingParams

    prompt = list(range(3, 40))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    toks = out.outputs[0].token_ids
    assert len(toks) == 20
    full = llm.llm_engine.prompt_logits(prompt + toks[:-1])
    expect = full[len(prompt) - 1:].argmax(-1).tolist()
    assert toks == expect
