"""Llama-family decoder (Llama 2, Llama 3 incl. llama3 rope scaling, Mistral incl. sliding windows, SmolLM2).

Parameter names follow Hugging Face so checkpoints load by name. Qwen2 (q/k/v bias) and Qwen3
(q/k RMSNorm) reuse these classes with flags, see ``qwen2.py`` and ``qwen3.py``. Each module's
``fusion_plan`` says which projections share an input and where their outputs go; the model
runner's fusion pass (``layers/fusion.py``) turns that into fused GEMMs after loading.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from lightinfer.layers.activation import gated_activation
from lightinfer.layers.attention import Attention, sliding_window_of
from lightinfer.layers.embed_head import LMHead, VocabEmbedding
from lightinfer.layers.fusion import RESIDUAL, Feeds, Fuse, FusionPlan, materialize
from lightinfer.layers.linear import make_linear
from lightinfer.layers.norm import RMSNorm
from lightinfer.layers.ops import ops_for
from lightinfer.layers.rotary import RotaryEmbedding, rope_spec
from lightinfer.models.awq_tables import LLAMA_TABLE, AwqTable
from lightinfer.models.base import CausalLM
from lightinfer.models.config_check import check_size


def head_dim_of(hf_config: object) -> int:
    """``head_dim`` from the config, or hidden / heads where the config has none."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def rotary_embedding_of(hf_config: object, layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary table of the config's ``layer_type`` layers (fp32 cos/sin ``[max_position, rotary_dim // 2]``,
    any RoPE scaling folded in: ``layers/rope_scaling.py``)."""
    return RotaryEmbedding(rope_spec(hf_config, layer_type))


class LlamaAttention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm, RoPE, paged attention, o projection.

    After the fusion pass ``qkv_proj`` replaces q/k/v; without q/k norms its output goes straight
    into the attention's RoPE + KV-cache write (``Attention.forward_qkv``).
    """

    def __init__(
        self, hf_config: object, layer_idx: int, quant_config: dict | None, dtype: torch.dtype,
        qkv_bias: bool, qk_norm: bool, rotary_emb: RotaryEmbedding | None = None, scale: float | None = None,
        softcap: float | None = None, norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        """``scale``: softmax scale (default ``head_dim ** -0.5``); ``softcap``: attention logit soft-capping;
        ``norm_cls``: the q/k norms' class (Gemma 3's scale by ``1 + weight``)."""
        super().__init__()
        c = hf_config
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = head_dim_of(c)
        p = f"model.layers.{layer_idx}.self_attn"
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = make_linear(c.hidden_size, q_out, qkv_bias, dtype, quant_config, f"{p}.q_proj")
        self.k_proj = make_linear(c.hidden_size, kv_out, qkv_bias, dtype, quant_config, f"{p}.k_proj")
        self.v_proj = make_linear(c.hidden_size, kv_out, qkv_bias, dtype, quant_config, f"{p}.v_proj")
        o_bias = bool(getattr(c, "attention_bias", False))  # Qwen2's config has no such field: False
        self.o_proj = make_linear(q_out, c.hidden_size, o_bias, dtype, quant_config, f"{p}.o_proj")
        self.q_norm = norm_cls(self.head_dim, c.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = norm_cls(self.head_dim, c.rms_norm_eps, dtype) if qk_norm else None
        self.rotary_emb = rotary_emb if rotary_emb is not None else rotary_embedding_of(c)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5 if scale is None else scale,
                              self.num_kv_heads, sliding_window=sliding_window_of(c, layer_idx), softcap=softcap)
        self.qkv_proj: nn.Module | None = None  # set by the fusion pass
        # With q/k norms the fused output is split and normed first: it does not go into attn as it is.
        self.fusion_plan = FusionPlan(fuse=(Fuse("qkv_proj", ("q_proj", "k_proj", "v_proj")),),
                                      feeds=() if qk_norm else (Feeds("qkv_proj", "attn"),))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions ``[T]``, hidden ``[T, hidden]`` -> ``[T, hidden]``."""
        if self.qkv_proj is not None and self.q_norm is None:
            # RoPE and the KV-cache write fused with the projection's epilogue (Attention.forward_qkv)
            return self.o_proj(self.attn.forward_qkv(positions, self.qkv_proj(hidden_states), self.rotary_emb))
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(hidden_states)
            # The q/k norms in place on the fused output where the backend does that (the CPU: one C call per
            # layer, so a recorded decode step can replay it), then RoPE + KV store fused as above.
            if self.q_norm is not None and isinstance(qkv, torch.Tensor) and ops_for(qkv).qk_rms_norm_(
                    qkv, self.num_heads, self.num_kv_heads, self.q_norm.kernel_weight(), self.k_norm.kernel_weight(),
                    self.q_norm.eps):
                return self.o_proj(self.attn.forward_qkv(positions, qkv, self.rotary_emb))
            q, k, v = self.attn.split_qkv(qkv)
        else:
            t = hidden_states.shape[0]
            q = self.q_proj(hidden_states).reshape(t, self.num_heads, self.head_dim)
            k = self.k_proj(hidden_states).reshape(t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(hidden_states).reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SiLU, or Gemma's tanh GELU); after the fusion pass ``gate_up_proj``
    replaces gate/up."""

    fusion_plan = FusionPlan(fuse=(Fuse("gate_up_proj", ("gate_proj", "up_proj")),),
                             feeds=(Feeds("gate_up_proj", "act_fn"),))

    def __init__(self, hf_config: object, layer_idx: int, quant_config: dict | None, dtype: torch.dtype,
                 intermediate_size: int | None = None, prefix: str | None = None) -> None:
        """``intermediate_size`` / ``prefix`` default to the config's and ``model.layers.{layer_idx}.mlp``
        (a MoE's shared expert has its own)."""
        super().__init__()
        h, i = hf_config.hidden_size, intermediate_size or hf_config.intermediate_size
        bias = bool(getattr(hf_config, "mlp_bias", False))
        p = prefix or f"model.layers.{layer_idx}.mlp"
        self.gate_proj = make_linear(h, i, bias, dtype, quant_config, f"{p}.gate_proj")
        self.up_proj = make_linear(h, i, bias, dtype, quant_config, f"{p}.up_proj")
        self.down_proj = make_linear(i, h, bias, dtype, quant_config, f"{p}.down_proj")
        # Gemma's configs name it hidden_activation, the others hidden_act
        act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None) or "silu"
        self.act_fn = gated_activation(act)
        self.gate_up_proj: nn.Module | None = None  # set by the fusion pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
        else:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(self.act_fn(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block on the plain residual stream: ``[T, hidden] -> [T, hidden]``."""

    qkv_bias = False
    qk_norm = False
    mlp_name: ClassVar[str] = "mlp"  # the feed-forward's attribute (checkpoint name): Mixtral's is block_sparse_moe
    # o_proj's output is the x of post_attention_layernorm's residual add; down_proj's is the block's
    # output, which the next block's input norm (or the final norm) adds to the residual.
    fusion_plan = FusionPlan(feeds=(Feeds("self_attn.o_proj", "post_attention_layernorm"),
                                    Feeds("mlp.down_proj", RESIDUAL)))

    def __init__(
        self, hf_config: object, layer_idx: int, quant_config: dict | None = None, dtype: torch.dtype = torch.float32,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(
            hf_config, layer_idx, quant_config, dtype, self.qkv_bias or bool(getattr(hf_config, "attention_bias", False)),
            self.qk_norm, rotary_emb,
        )
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        setattr(self, self.mlp_name, self.build_mlp(hf_config, layer_idx, quant_config, dtype))

    def build_mlp(self, hf_config: object, layer_idx: int, quant_config: dict | None, dtype: torch.dtype) -> nn.Module:
        """The feed-forward of layer ``layer_idx`` (``[T, hidden] -> [T, hidden]``): a dense MLP here; MoE
        architectures return their sparse block where the config makes the layer sparse."""
        return LlamaMLP(hf_config, layer_idx, quant_config, dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions ``[T]``, hidden ``[T, hidden]`` -> the block's output ``[T, hidden]`` (residual added)."""
        out, residual = self.forward_fused(positions, hidden_states, None)
        return residual + materialize(out)

    def forward_fused(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with its last residual add left to the next norm (as vLLM does).

        The stream entering the block is ``hidden_states + residual`` (``hidden_states`` alone when
        ``residual`` is None); the input norm adds them in the same kernel. Returns ``(mlp_out,
        residual)``, whose sum is the block's output: the next block's input norm, or the final norm,
        adds them, which saves a separate add kernel per layer on the GPU. On the Triton path
        ``mlp_out`` (and so ``hidden_states``) may be a W4A16 GEMM's unreduced split-K partials
        (the fusion pass defers ``down_proj``'s reduction), which that norm sums as it loads them.
        """
        if residual is None:
            normed, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            normed, residual = self.input_layernorm(hidden_states, residual)
        attn_out = self.self_attn(positions, normed)
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        return getattr(self, self.mlp_name)(normed), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(
        self, hf_config: object, quant_config: dict | None, dtype: torch.dtype, layer_cls: type[LlamaDecoderLayer]
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        # One cos/sin table for all layers: per layer it would cost layers x max_position x head_dim x 4
        # bytes (537 MiB for Mistral-7B's 32k positions), a real share of an 8 GiB card.
        rotary = rotary_embedding_of(hf_config)
        self.layers = nn.ModuleList(
            layer_cls(hf_config, i, quant_config, dtype, rotary) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids ``[T]`` (or ``inputs_embeds [T, hidden]``, already embedded), positions ``[T]``
        -> ``[T, hidden]``."""
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer.forward_fused(positions, hidden, residual)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    """The causal LM: ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` and
    ``compute_logits(hidden [S, hidden]) -> fp32 [S, vocab]``; attention metadata comes from
    ``lightinfer.layers.attention.set_context``. See :class:`CausalLM`."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    awq_table: ClassVar[AwqTable | None] = LLAMA_TABLE

    def __init__(self, hf_config: object, quant_config: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, quant_config, dtype, self.decoder_layer_cls)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def validate_config(cls, hf_config: object, where: str, field_names: dict[str, str] | None = None) -> None:
        """The base sizes plus this family's: ``intermediate_size`` (the MLP), a SiLU MLP and a positive
        ``rms_norm_eps``. Raises ValueError naming ``where`` and the field."""
        super().validate_config(hf_config, where, field_names)
        get = hf_config.get if isinstance(hf_config, dict) else lambda k: getattr(hf_config, k, None)
        check_size(hf_config, "intermediate_size", where, required=not isinstance(hf_config, dict),
                   field_names=field_names)
        act = get("hidden_act")
        if act is not None and act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported by {cls.__name__} (only silu)")
        eps = get("rms_norm_eps")
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
            raise ValueError(f"{where}: rms_norm_eps is {eps!r}; it must be a small positive number (e.g. 1e-5)")

    @classmethod
    def decoder_linear_shapes(cls, hf_config: object) -> dict[str, tuple[int, int]]:
        """``(out_features, in_features)`` of the seven linears of one block, from the config."""
        c = hf_config
        h, i = int(c.hidden_size), int(c.intermediate_size)
        q, kv = int(c.num_attention_heads) * head_dim_of(c), int(c.num_key_value_heads) * head_dim_of(c)
        return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}

    @classmethod
    def linear_input_sizes(cls, hf_config: object) -> dict[str, int]:
        """The input sizes of the decoder's linear layers, by config field (what a group size must
        divide): q/k/v and gate/up read ``hidden_size``, o reads heads x head_dim, down reads
        ``intermediate_size``."""
        return {"hidden_size": hf_config.hidden_size, "intermediate_size": hf_config.intermediate_size,
                "num_attention_heads * head_dim": hf_config.num_attention_heads * head_dim_of(hf_config)}

    @classmethod
    def weight_bytes_by_part(cls, hf_config: object, bits: int = 16, group_size: int = 128,
                             dtype_bytes: int = 2) -> dict[str, int]:
        """Weight bytes by part from the config alone (``models/sizes.py``: embedding, head, attention, MLP...),
        the decoder linears at ``bits`` (16: dense; 4: the W4 layout with ``group_size``)."""
        from lightinfer.models.sizes import llama_family_weight_bytes

        layer = cls.decoder_layer_cls
        return llama_family_weight_bytes(hf_config, None, bits, group_size, dtype_bytes, head_dim_of(hf_config),
                                         qkv_bias=bool(layer.qkv_bias), qk_norm=bool(layer.qk_norm))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    @property
    def embed_tokens(self) -> VocabEmbedding:
        """The input embedding (the engine may keep it in host memory, see ``offload_to_host``)."""
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
