"""Phi-3, Phi-3.5 and Phi-4-mini (``Phi3ForCausalLM``): the Llama block with its projections fused on disk.

* ``self_attn.qkv_proj`` (``[(H + 2 Hkv) D, hidden]``: q rows, then k, then v) and ``mlp.gate_up_proj``
  (``[2 I, hidden]``: gate rows, then up) are single tensors in the checkpoint, so they are single linears
  here: nothing for the fusion pass to fuse, and a GGUF's ``attn_qkv`` / ``ffn_up`` load into them by name.
* LongRoPE (``rope_scaling.type`` "longrope", or the older "su"): short and long per-frequency factors and an
  attention factor, in the rotary table (``layers/rope_scaling.py``).
* Phi-4-mini rotates only ``partial_rotary_factor`` (3/4) of each head.
* A ``sliding_window`` below the context (Phi-3-mini-4k: 2047) makes every layer a sliding-window layer.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from lightinfer.layers.activation import gated_activation
from lightinfer.layers.attention import Attention, sliding_window_of
from lightinfer.layers.fusion import Feeds, FusionPlan
from lightinfer.layers.linear import make_linear
from lightinfer.layers.norm import RMSNorm
from lightinfer.layers.rotary import RotaryEmbedding
from lightinfer.models.awq_tables import PHI3_TABLE, AwqTable
from lightinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM, head_dim_of, rotary_embedding_of


class Phi3Attention(nn.Module):
    """``qkv_proj`` -> RoPE (partial where the config says) -> paged attention -> ``o_proj``."""

    # The fused projection's output goes as it is into the RoPE + KV-cache write (Attention.forward_qkv).
    fusion_plan = FusionPlan(feeds=(Feeds("qkv_proj", "attn"),))

    def __init__(self, hf_config: object, layer_idx: int, quant_config: dict | None, dtype: torch.dtype,
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        c = hf_config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, head_dim_of(c)
        p = f"model.layers.{layer_idx}.self_attn"
        q_out = self.num_heads * self.head_dim
        self.qkv_proj = make_linear(c.hidden_size, q_out + 2 * self.num_kv_heads * self.head_dim, False, dtype,
                                    quant_config, f"{p}.qkv_proj")
        self.o_proj = make_linear(q_out, c.hidden_size, False, dtype, quant_config, f"{p}.o_proj")
        self.rotary_emb = rotary_emb if rotary_emb is not None else rotary_embedding_of(c)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
                              sliding_window=sliding_window_of(c, layer_idx))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions ``[T]``, hidden ``[T, hidden]`` -> ``[T, hidden]``."""
        return self.o_proj(self.attn.forward_qkv(positions, self.qkv_proj(hidden_states), self.rotary_emb))


class Phi3MLP(nn.Module):
    """``down(silu(gate) * up)`` with ``[gate | up] = gate_up_proj(x)``."""

    fusion_plan = FusionPlan(feeds=(Feeds("gate_up_proj", "act_fn"),))

    def __init__(self, hf_config: object, layer_idx: int, quant_config: dict | None, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = hf_config.hidden_size, hf_config.intermediate_size
        p = f"model.layers.{layer_idx}.mlp"
        self.gate_up_proj = make_linear(h, 2 * i, False, dtype, quant_config, f"{p}.gate_up_proj")
        self.down_proj = make_linear(i, h, False, dtype, quant_config, f"{p}.down_proj")
        self.act_fn = gated_activation(getattr(hf_config, "hidden_act", None) or "silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (same norms, same fused residual adds) around :class:`Phi3Attention` and
    :class:`Phi3MLP`."""

    def __init__(
        self, hf_config: object, layer_idx: int, quant_config: dict | None = None, dtype: torch.dtype = torch.float32,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        self.self_attn = Phi3Attention(hf_config, layer_idx, quant_config, dtype, rotary_emb)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        self.mlp = Phi3MLP(hf_config, layer_idx, quant_config, dtype)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini causal LM (same interface as :class:`LlamaForCausalLM`)."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = Phi3DecoderLayer
    awq_table: ClassVar[AwqTable | None] = PHI3_TABLE

    @classmethod
    def decoder_linear_shapes(cls, hf_config: object) -> dict[str, tuple[int, int]]:
        """``(out_features, in_features)`` of the four linears of one block as the checkpoint stores them
        (q/k/v and gate/up fused), from the config."""
        c = hf_config
        h, i = int(c.hidden_size), int(c.intermediate_size)
        q, kv = int(c.num_attention_heads) * head_dim_of(c), int(c.num_key_value_heads) * head_dim_of(c)
        return {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q), "mlp.gate_up_proj": (2 * i, h),
                "mlp.down_proj": (h, i)}

