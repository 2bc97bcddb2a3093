"""Model classes by Hugging Face ``architectures`` name; each implements :class:`CausalLM`
(``models/base.py``), through which the engine and the quantizer reach per-architecture facts."""

from __future__ import annotations

from lightinfer.models.base import CausalLM
from lightinfer.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from lightinfer.models.llama import LlamaForCausalLM
from lightinfer.models.mixtral import MixtralForCausalLM
from lightinfer.models.phi3 import Phi3ForCausalLM
from lightinfer.models.qwen2 import Qwen2ForCausalLM
from lightinfer.models.qwen2_moe import Qwen2MoeForCausalLM
from lightinfer.models.qwen3 import Qwen3ForCausalLM
from lightinfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
# Checkpoints of the bare decoder (transformers' `Qwen3Model`...: no LM head, tensor names with or without the
# `model.` prefix), which embedding models ship: the causal LM's class runs them, without its head (a pooling
# engine only: EngineConfig.runner).
BASE_MODEL_ARCHITECTURES: dict[str, str] = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                                            "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
# GGUF files carry no `architectures`; their model_type says it.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


def architecture_of(hf_config: object) -> str:
    """The architecture name of a transformers config (``architectures[0]`` or by ``model_type``)."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", None)
    return _BY_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>")


def get_model_class(hf_config: object) -> type[CausalLM]:
    """The lightinfer class for ``hf_config``.

    Raises:
        ValueError: the architecture is not supported; the message lists those that are.
    """
    arch = architecture_of(hf_config)
    arch = BASE_MODEL_ARCHITECTURES.get(arch, arch)
    if arch not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {arch} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))} (and "
            f"{', '.join(sorted(BASE_MODEL_ARCHITECTURES))}, without an LM head: embedding models)"
        )
    return MODEL_REGISTRY[arch]


def has_lm_head_architecture(hf_config: object) -> bool:
    """False for a bare decoder's architecture (``BASE_MODEL_ARCHITECTURES``: no LM head, embeddings only)."""
    return architecture_of(hf_config) not in BASE_MODEL_ARCHITECTURES


def quantizable_architectures() -> list[str]:
    """The registered architectures ``quantize`` handles (their class has an AWQ table), sorted."""
    return sorted(arch for arch, cls in MODEL_REGISTRY.items() if cls.awq_table is not None)


def validate_model_config(hf_config: object, where: str, field_names: dict[str, str] | None = None) -> None:
    """Run the registered class's :meth:`~lightinfer.models.base.CausalLM.validate_config` on ``hf_config``
    (a transformers config or the raw ``config.json`` dict); an unregistered architecture is left to
    :func:`get_model_class`, whose message lists the supported ones.

    Raises:
        ValueError: naming ``where`` and the field.
    """
    if isinstance(hf_config, dict):
        archs = hf_config.get("architectures") or []
        model_type = hf_config.get("model_type")
        arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else \
            _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    else:
        arch = architecture_of(hf_config)
    cls = MODEL_REGISTRY.get(BASE_MODEL_ARCHITECTURES.get(arch, arch)) if isinstance(arch, str) else None
    if cls is not None:
        cls.validate_config(hf_config, where, field_names)
