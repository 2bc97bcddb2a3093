"""Gemma 2 and Gemma 3 (text): the Llama attention and MLP with Gemma's differences.

* RMSNorm scales by ``1 + weight`` (``OffsetRMSNorm``), and every block has four of them: the attention's
  and the MLP's outputs are normed before they join the residual stream (post-attention and
  post-feed-forward norms) as well as their inputs (input and pre-feed-forward norms).
* Token embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the activation dtype, as Gemma does).
* The MLP is GeGLU with the tanh approximation of GELU (``hidden_activation: gelu_pytorch_tanh``).
* The softmax scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
* Local and global layers interleave (``layer_types``): local ones attend within a sliding window
  (``sliding_window``), which the engine's KV cache exploits (``engine/block_manager.py``).
* Gemma 2: attention logits and final logits are soft-capped, ``cap * tanh(x / cap)``.
* Gemma 3: per-head RMSNorm on q and k before RoPE, and local layers have their own RoPE base
  (``rope_local_base_freq``, 10k) while global ones use ``rope_theta`` (1M) with a scaling (linear x8 in the
  4B and larger models).

The fusion plan: q/k/v and gate/up fuse as in Llama; gate/up's output goes to the GeGLU as it is, and so does
qkv's into the attention when there are no q/k norms (Gemma 2). Nothing goes straight from o_proj or
down_proj into a residual add: a post norm sits between (a norm without a residual sums no split-K
partials, ``layers/norm.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from lightinfer.layers.attention import sliding_window_of
from lightinfer.layers.embed_head import LMHead, VocabEmbedding
from lightinfer.layers.fusion import FusionPlan, materialize
from lightinfer.layers.norm import OffsetRMSNorm
from lightinfer.layers.rope_scaling import layer_types_of
from lightinfer.layers.rotary import RotaryEmbedding
from lightinfer.models.awq_tables import GEMMA_TABLE, AwqTable
from lightinfer.models.base import CausalLM
from lightinfer.models.llama import LlamaAttention, LlamaMLP, head_dim_of, rotary_embedding_of


class Gemma2DecoderLayer(nn.Module):
    """Gemma's block (module docstring): ``[T, hidden] -> [T, hidden]``."""

    qk_norm = False
    fusion_plan = FusionPlan()  # the post norms sit between o_proj / down_proj and the residual adds

    def __init__(
        self, hf_config: object, layer_idx: int, quant_config: dict | None = None, dtype: torch.dtype = torch.float32,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        c = hf_config
        if getattr(c, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (Gemma's encoder use) is not a causal LM; lightinfer "
                             "runs the causal models only")
        self.layer_idx = layer_idx
        self.is_sliding = sliding_window_of(c, layer_idx) is not None
        if rotary_emb is None:  # built alone (the quantizer): its layer type's RoPE
            rotary_emb = rotary_embedding_of(c, layer_types_of(c)[layer_idx])
        h, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps, dtype)
        self.self_attn = LlamaAttention(
            c, layer_idx, quant_config, dtype, bool(getattr(c, "attention_bias", False)), self.qk_norm, rotary_emb,
            scale=float(c.query_pre_attn_scalar) ** -0.5, softcap=getattr(c, "attn_logit_softcapping", None),
            norm_cls=OffsetRMSNorm,
        )
        self.post_attention_layernorm = OffsetRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype)
        self.mlp = LlamaMLP(c, layer_idx, quant_config, dtype)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions ``[T]``, hidden ``[T, hidden]`` -> the block's output ``[T, hidden]`` (residual added)."""
        out, residual = self.forward_fused(positions, hidden_states, None)
        return residual + materialize(out)

    def forward_fused(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward_fused``: the stream entering is ``hidden_states + residual``; returns
        ``(mlp_out, residual)`` whose sum is the block's output, added by the next input norm."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            normed, residual = self.input_layernorm(hidden_states, residual)
        attn_out = self.post_attention_layernorm(materialize(self.self_attn(positions, normed)))
        normed, residual = self.pre_feedforward_layernorm(attn_out, residual)
        return self.post_feedforward_layernorm(materialize(self.mlp(normed))), residual


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 3's block: Gemma 2's with q/k RMSNorm (``1 + weight``) before RoPE."""

    qk_norm = True


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers (each given its layer type's rotary table), final norm."""

    def __init__(self, hf_config: object, quant_config: dict | None, dtype: torch.dtype,
                 layer_cls: type[Gemma2DecoderLayer]) -> None:
        super().__init__()
        c = hf_config
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, dtype)
        # Gemma multiplies by sqrt(hidden) rounded to the activation dtype (a Python float of that value gives
        # the same products).
        self.embed_scale = float(torch.tensor(Gemma2ForCausalLM.input_embedding_scale(c), dtype=dtype, device="cpu"))
        types = layer_types_of(c)
        # One table per layer type (Gemma 3's local and global RoPE differ; Gemma 2's are one table).
        self.rotary = nn.ModuleDict({t: rotary_embedding_of(c, t) for t in sorted(set(types))})
        self.layers = nn.ModuleList(layer_cls(c, i, quant_config, dtype, self.rotary[types[i]])
                                    for i in range(c.num_hidden_layers))
        self.norm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids ``[T]`` (or ``inputs_embeds [T, hidden]``, the embedding's raw rows) -> ``[T, hidden]``."""
        hidden = (inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)) * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer.forward_fused(positions, hidden, residual)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 causal LM (interface: :class:`CausalLM`); the LM head is tied to the embedding unless the config
    says otherwise, and its logits are soft-capped by ``final_logit_softcapping``."""

    decoder_layer_cls: ClassVar[type[Gemma2DecoderLayer]] = Gemma2DecoderLayer
    awq_table: ClassVar[AwqTable | None] = GEMMA_TABLE

    def __init__(self, hf_config: object, quant_config: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = hf_config
        self.model = GemmaModel(hf_config, quant_config, dtype, self.decoder_layer_cls)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    @classmethod
    def input_embedding_scale(cls, hf_config: object) -> float:
        """``sqrt(hidden_size)``."""
        return float(hf_config.hidden_size) ** 0.5

    @classmethod
    def linear_input_sizes(cls, hf_config: object) -> dict[str, int]:
        """As Llama's: q/k/v and gate/up read ``hidden_size``, o reads heads x head_dim, down ``intermediate_size``."""
        return {"hidden_size": hf_config.hidden_size, "intermediate_size": hf_config.intermediate_size,
                "num_attention_heads * head_dim": hf_config.num_attention_heads * head_dim_of(hf_config)}

    @classmethod
    def estimate_weight_bytes(cls, hf_config: object, quant_config: dict | None,
                              dtype: torch.dtype) -> tuple[int, int]:
        """The base class's arithmetic plus what Gemma adds: a rotary table per layer type (sliding and
        global) and the pre/post feed-forward norms of every layer."""
        weights, dense = super().estimate_weight_bytes(hf_config, quant_config, dtype)
        c = hf_config
        head_dim = int(getattr(c, "head_dim", None) or int(c.hidden_size) // int(c.num_attention_heads))
        positions = int(getattr(c, "max_position_embeddings", 0) or 0)
        weights += (len(set(layer_types_of(c))) - 1) * 2 * positions * (head_dim // 2) * 4  # cos and sin, fp32
        weights += 2 * int(c.num_hidden_layers) * int(c.hidden_size) * torch.empty(0, dtype=dtype).element_size()
        return weights, dense

    @classmethod
    def weight_bytes_by_part(cls, hf_config: object, bits: int = 16, group_size: int = 128,
                             dtype_bytes: int = 2) -> dict[str, int]:
        """Weight bytes by part from the config alone: Llama's arithmetic (``models/sizes.py``) plus the
        pre/post feed-forward norms Gemma adds to every layer."""
        from lightinfer.models.sizes import llama_family_weight_bytes

        c = hf_config
        parts = llama_family_weight_bytes(c, None, bits, group_size, dtype_bytes, head_dim_of(c),
                                          qkv_bias=bool(getattr(c, "attention_bias", False)),
                                          qk_norm=cls.decoder_layer_cls.qk_norm)
        parts["norms"] += 2 * int(c.num_hidden_layers) * int(c.hidden_size) * dtype_bytes
        return parts

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    @property
    def embed_tokens(self) -> VocabEmbedding:
        """The input embedding (the engine may keep it in host memory, see ``offload_to_host``)."""
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM (``gemma3_text``; the 1B model, or a multimodal model's text part saved alone)."""

    decoder_layer_cls = Gemma3DecoderLayer
