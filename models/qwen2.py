"""Qwen2 / Qwen2.5: the Llama block with bias on the q/k/v projections."""

from __future__ import annotations

from lightinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """Llama block, q/k/v projections with bias."""

    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM (same interface as :class:`LlamaForCausalLM`)."""

    decoder_layer_cls = Qwen2DecoderLayer
