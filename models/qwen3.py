"""Qwen3 (dense): the Llama block with per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from lightinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama block with ``q_norm``/``k_norm`` (RMSNorm over head_dim)."""

    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM (same interface as :class:`LlamaForCausalLM`)."""

    decoder_layer_cls = Qwen3DecoderLayer
