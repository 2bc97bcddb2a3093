"""Tiny random-weight configs of the architectures and RoPE scalings of issue 18, built from the real
transformers config classes: sliding windows shorter than the prompts (local layers really drop tokens) and
RoPE scalings active at the tested lengths (prompts past the original length)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import write_tiny_checkpoint

SLIDING, FULL = "sliding_attention", "full_attention"


def longrope(n: int) -> dict:
    """A LongRoPE scaling with ``n`` short and long factors (rotary_dim // 2 of them)."""
    return {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.3 + 0.4 * i for i in range(n)]}


PHI_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabulary
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 20, "sliding_window": 24}

# name -> (architecture, config overrides, prompt lengths: the longest also the prefill-parity prompt)
CASES: dict[str, tuple[str, dict, tuple[int, ...]]] = {
    "gemma2": ("Gemma2ForCausalLM", {**GEMMA, "num_hidden_layers": 4, "attn_logit_softcapping": 1.0,
                                     "final_logit_softcapping": 3.0, "tie_word_embeddings": True}, (37, 90, 150)),
    "gemma3": ("Gemma3ForCausalLM", {**GEMMA, "num_hidden_layers": 4, "layer_types": [SLIDING, SLIDING, FULL, SLIDING],
                                     "max_position_embeddings": 256,
                                     "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                                         FULL: {"rope_type": "linear", "factor": 4.0,
                                                                "rope_theta": 1e6}}}, (37, 90, 150)),
    "phi3-longrope": ("Phi3ForCausalLM", {**PHI_IDS, "original_max_position_embeddings": 64,
                                          "rope_scaling": longrope(8)}, (70, 100, 150)),
    "phi4mini-partial-rotary": ("Phi3ForCausalLM", {**PHI_IDS, "original_max_position_embeddings": 64,
                                                    "partial_rotary_factor": 0.75, "rope_scaling": longrope(6),
                                                    "tie_word_embeddings": True}, (70, 100, 150)),
    "phi3-sliding": ("Phi3ForCausalLM", {**PHI_IDS, "sliding_window": 40}, (37, 90, 150)),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 24}, (37, 90, 150)),
    "qwen2-sliding-yarn": ("Qwen2ForCausalLM", {"num_hidden_layers": 3, "use_sliding_window": True,
                                                "sliding_window": 24, "max_window_layers": 1,
                                                "max_position_embeddings": 256,
                                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 64}},
                           (37, 90, 150)),
    "llama-linear": ("LlamaForCausalLM", {"max_position_embeddings": 128,
                                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, (37, 90, 150)),
    # dynamic NTK: transformers scales for the sequence's own length, lightinfer for max_model_len (= 128 here):
    # they agree on a max_model_len-token prompt, and that is the one tested (no decode past it)
    "llama-dynamic": ("LlamaForCausalLM", {"max_position_embeddings": 64,
                                           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, (128,)),
}


def write_case(path: Path, name: str) -> Path:
    """The checkpoint of case ``name`` at ``path`` (norms and biases randomized, tokenizer included)."""
    arch, overrides, _ = CASES[name]
    return write_tiny_checkpoint(path, arch, seed=len(name), **overrides)


def prompts(name: str) -> list[list[int]]:
    """The case's prompts (fixed random ids, lengths from :data:`CASES`)."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 258, (n,), generator=gen).tolist() for n in CASES[name][2]]


def hf_model(path: Path) -> torch.nn.Module:
    """transformers' own model of the checkpoint (fp32, eager attention), the oracle."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens by a full forward per step (no cache: the definition, whatever transformers' caches do)."""
    out = list(ids)
    for _ in range(steps):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]
