"""Mixture-of-experts models against transformers on tiny random-weight checkpoints built from the real config
classes (2-4 layers, 8 experts, top-2): prefill logits, greedy decoding through the paged cache with batched
prompts of different lengths and prefix caching, and a bad config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightinfer import LLM, SamplingParams
from tests.conftest import write_tiny_checkpoint

# Every family, and Qwen3-MoE with dense layers among the sparse ones (decoder_sparse_step, mlp_only_layers).
MOE_CASES: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "head_dim": 16, "norm_topk_prob": True}),
    "qwen3-moe-mixed-layers": ("Qwen3MoeForCausalLM", {
        "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": False, "tie_word_embeddings": True}),
    "qwen2-moe-shared-expert": ("Qwen2MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                        "moe_intermediate_size": 32,
                                                        "shared_expert_intermediate_size": 64}),
}


def moe_checkpoint(root: Path, case: str) -> Path:
    arch, overrides = MOE_CASES[case]
    return write_tiny_checkpoint(root / case, arch, **overrides)


def hf_model(path: Path, case: str) -> torch.nn.Module:
    import transformers

    return getattr(transformers, MOE_CASES[case][0]).from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {case: moe_checkpoint(root, case) for case in MOE_CASES}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_prefill_logits_match_transformers(checkpoints: dict[str, Path], case: str) -> None:
    path = checkpoints[case]
    hf = hf_model(path, case)
    # 150 tokens: several KV blocks, and with a 64-token step budget three chunks (prefill over a cached prefix)
    ids = torch.randint(0, 258, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=64, num_kv_blocks=32)
    ours = llm.llm_engine.prompt_logits(ids)
    assert ours.shape == ref.shape
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"{case}: max |logits diff| / max |logits| = {rel:.2e}"
    assert ref.std() > 0.1  # not vacuous on near-constant logits
    moe = [m for m in llm.llm_engine.model_runner.model.modules() if type(m).__name__ == "FusedMoE"]
    assert len(moe) == len(llm.llm_engine.model_runner.model.moe_layer_ids(hf.config)) > 0


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe-shared-expert", "qwen3-moe-mixed-layers"])
def test_greedy_batched_paged_decode_with_prefix_caching(checkpoints: dict[str, Path], case: str) -> None:
    """32 greedy tokens for three prompts of different lengths decoded together through the paged cache, then
    again with their shared 32-token prefix served from the prefix cache: the tokens transformers picks."""
    path = checkpoints[case]
    hf = hf_model(path, case)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 258, (32,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 258, (n,), generator=gen).tolist() for n in (3, 19, 45)]
    expected = [_hf_greedy(hf, p, 32) for p in prompts]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=48, num_kv_blocks=64, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for run in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"run {run}"
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


def test_top_k_larger_than_num_experts_is_a_clear_error_at_load(tmp_path: Path) -> None:
    import json

    path = moe_checkpoint(tmp_path, "qwen3-moe")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be between 1 and the number of experts \(8\)"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)
