"""Model classes by Hugging Face ``architectures`` name."""

from __future__ import annotations

from torch import nn

from lightinfer.models.llama import LlamaForCausalLM
from lightinfer.models.qwen2 import Qwen2ForCausalLM
from lightinfer.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
# GGUF files carry no `architectures`; their model_type says it.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def architecture_of(hf_config: object) -> str:
    """The architecture name of a transformers config (``architectures[0]`` or by ``model_type``)."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", None)
    return _BY_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>")


def get_model_class(hf_config: object) -> type[nn.Module]:
    """The lightinfer class for ``hf_config``.

    Raises:
        ValueError: the architecture is not supported; the message lists those that are.
    """
    arch = architecture_of(hf_config)
    if arch not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {arch} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[arch]
