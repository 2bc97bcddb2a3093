"""Mixtral (8x7B, 8x22B): the Mistral block with a sparse MoE feed-forward in every layer, named
``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down); routing is a softmax over the
top-k logits (the top-k probabilities renormalized)."""

from __future__ import annotations

from lightinfer.models.awq_tables import MIXTRAL_TABLE
from lightinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from lightinfer.models.moe import MoeCausalLMMixin, MoeDecoderMixin
from lightinfer.models.moe_spec import MoeSpec

MIXTRAL = MoeSpec(num_experts="num_local_experts", intermediate="intermediate_size", block_name="block_sparse_moe",
                  proj_names=("w1", "w3", "w2"), norm_topk_field=None, sparse_step=False)


class MixtralDecoderLayer(MoeDecoderMixin, LlamaDecoderLayer):
    """Mistral block with the sparse feed-forward ``block_sparse_moe``."""

    moe_spec = MIXTRAL
    mlp_name = "block_sparse_moe"


class MixtralForCausalLM(MoeCausalLMMixin, LlamaForCausalLM):
    """Mixtral causal LM (the :class:`~lightinfer.models.base.CausalLM` interface)."""

    moe_spec = MIXTRAL
    decoder_layer_cls = MixtralDecoderLayer
    awq_table = MIXTRAL_TABLE
