"""``CausalLM``: what the engine, model runner, loader and quantizer use of a model class.

Every class in ``models/registry.py`` implements it. The engine reaches class-level facts
(``linear_input_sizes``, ``awq_table``, ``decoder_layer_cls``) through the registered class
(``get_model_class(hf_config)``), never by importing one architecture's module, so a new family
only has to implement this interface and register itself.

How to add a model: build it from ``lightinfer.layers`` with Hugging Face parameter names (so
checkpoints load by name), declare which projections share an input and where their outputs
go as a ``fusion_plan`` (``layers/fusion.py``; the model runner applies it after loading), give
its AWQ table (``awq_tables.py``) if ``quantize`` should handle it, and register it.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch
from torch import nn

from lightinfer.layers.embed_head import VocabEmbedding
from lightinfer.layers.linear import linear_nbytes
from lightinfer.layers.quant_embed import table_cpu_copy_nbytes
from lightinfer.layers.rotary import RotaryEmbedding
from lightinfer.models.awq_tables import AwqTable
from lightinfer.models.config_check import check_decoder_sizes


class CausalLM(nn.Module, metaclass=abc.ABCMeta):
    """A decoder-only causal LM over the paged KV cache.

    Constructed as ``cls(hf_config, quant_config=None, dtype=torch.float32)``: ``hf_config`` a
    transformers config, ``quant_config`` a checkpoint's ``quantization_config`` (None: dense).
    Attention metadata (slots, block tables) comes from ``lightinfer.layers.attention.set_context``,
    not from arguments.

    Attributes:
        config: the transformers config the model was built from.
        tie_word_embeddings: the LM head shares the input embedding's weight (the loader skips
            ``lm_head.weight``; CPU packing keeps the shared weight).
        decoder_layer_cls: class of one decoder layer, buildable alone as
            ``decoder_layer_cls(hf_config, layer_idx, quant_config=None, dtype=torch.float32)``,
            with parameter names those of the checkpoint under ``model.layers.{layer_idx}.`` and
            ``forward(positions [T], hidden [T, hidden]) -> [T, hidden]`` (the quantizer runs
            the model one layer at a time through it, inside ``no_cache_context``).
        awq_table: which linears of a decoder layer share which input, for AWQ
            (``awq_tables.py``); None where ``quantize`` does not handle the architecture.
    """

    decoder_layer_cls: ClassVar[type[nn.Module]]
    awq_table: ClassVar[AwqTable | None] = None

    config: object
    tie_word_embeddings: bool

    @abc.abstractmethod
    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids`` int64 ``[T]`` (or ``inputs_embeds [T, hidden]``, already embedded; then
        ``input_ids`` may be None), ``positions`` int64 ``[T]`` -> final hidden states ``[T, hidden]``."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, hidden]`` -> fp32 logits ``[S, vocab]``."""

    @property
    @abc.abstractmethod
    def embed_tokens(self) -> VocabEmbedding:
        """The input embedding (the engine may keep it in host memory, see ``offload_to_host``)."""

    @classmethod
    def validate_config(cls, hf_config: object, where: str, field_names: dict[str, str] | None = None) -> None:
        """Refuse a config this class cannot be built from, before anything is built or allocated.

        The base checks the sizes every decoder config has (``models/config_check.py``: positive, within
        sane bounds, heads consistent); an architecture overrides this to add its own fields and calls
        ``super().validate_config(...)``. Called by the loader on the raw ``config.json`` dict (fields
        left out are skipped: transformers fills its defaults) and again on the transformers config.

        Args:
            hf_config: a transformers config, or the raw ``config.json`` dict.
            where: the file it came from, named in the message.
            field_names: how the file names the fields where that differs (a GGUF's metadata keys).
        Raises:
            ValueError: naming ``where`` and the field, what is wrong and what is accepted.
        """
        check_decoder_sizes(hf_config, where, field_names)

    @classmethod
    def estimate_weight_bytes(cls, hf_config: object, quant_config: dict | None,
                              dtype: torch.dtype) -> tuple[int, int]:
        """Host or device bytes the model will hold, by arithmetic on the config (nothing is built, so a
        huge config costs nothing to estimate; ``validate_config`` has bounded its sizes).

        Counts the decoder linears in their formats (``layers.linear.linear_nbytes``), the embedding and
        an untied LM head in ``dtype``, two norms per layer, the final norm and the fp32 rotary table;
        biases and per-head norms are left out (well under 1%).

        Returns:
            ``(weights, cpu_dense)``: the model's parameters and buffers, and what a CPU engine's GEMM forms
            add to them (``weights + cpu_dense`` is what it holds): the dense copies it keeps of its quantized
            linears and of a GGUF file's quantized embedding / head tables
            (``layers.quant_embed.table_cpu_copy_nbytes``: a W8 table an embedding reads keeps 16-bit rows).
        """
        elem = torch.empty(0, dtype=dtype).element_size()
        c = hf_config
        shapes = cls.decoder_linear_shapes(c)
        weights = dense = 0
        for i in range(int(c.num_hidden_layers)):
            for name, (out_features, in_features) in shapes.items():
                stored, copy = linear_nbytes(in_features, out_features, False, dtype, quant_config,
                                             f"model.layers.{i}.{name}")
                weights, dense = weights + stored, dense + copy
        hidden, vocab = int(c.hidden_size), int(c.vocab_size)
        tied = bool(getattr(c, "tie_word_embeddings", False))
        weights += vocab * hidden * elem * (1 if tied else 2) + (2 * int(c.num_hidden_layers) + 1) * hidden * elem
        dense += table_cpu_copy_nbytes(quant_config, vocab, hidden, tied, dtype)
        head_dim = getattr(c, "head_dim", None) or hidden // int(c.num_attention_heads)
        positions = int(getattr(c, "max_position_embeddings", 0) or 0)
        weights += 2 * positions * (int(head_dim) // 2) * 4  # cos and sin, fp32
        return weights, dense

    @classmethod
    def decoder_linear_shapes(cls, hf_config: object) -> dict[str, tuple[int, int]]:
        """``(out_features, in_features)`` of every linear of one decoder layer, by submodule path
        (``"self_attn.q_proj"``). Default: read from one layer built on the meta device (allocates
        nothing); architectures may compute them from the config instead."""
        with torch.device("meta"):
            layer = cls.decoder_layer_cls(hf_config, 0, quant_config=None, dtype=torch.float32)
        return {name: (m.out_features, m.in_features) for name, m in layer.named_modules()
                if hasattr(m, "in_features") and hasattr(m, "out_features")}

    @classmethod
    def awq_table_for(cls, hf_config: object, layer_idx: int) -> AwqTable | None:
        """The AWQ table of decoder layer ``layer_idx`` (MoE models mix sparse and dense layers); default
        :attr:`awq_table`."""
        return cls.awq_table

    @classmethod
    def weight_bytes_by_part(cls, hf_config: object, bits: int = 16, group_size: int = 128,
                             dtype_bytes: int = 2) -> dict[str, int]:
        """Weight bytes by part (embedding, LM head, attention, MLP, experts...) from the config alone, the
        decoder linears at ``bits`` (16: dense) with ``group_size``: what a memory plan or ``fit`` needs before a
        checkpoint is read. Architectures implement it (``models/sizes.py`` has the Llama family's arithmetic).

        Raises:
            NotImplementedError: the architecture does not implement it.
        """
        raise NotImplementedError(f"{cls.__name__} does not compute its weight bytes from the config")

    @classmethod
    def moe_layer_ids(cls, hf_config: object) -> list[int]:
        """The decoder layers with a sparse mixture-of-experts block (none for a dense model)."""
        return []

    @classmethod
    def linear_input_sizes(cls, hf_config: object) -> dict[str, int]:
        """The input sizes of the decoder's linears (what a quantization group size must divide),
        keyed by a name for error messages. Default: each linear's ``in_features`` by path;
        architectures may name them by config field instead."""
        return {f"{name}.in_features": k for name, (_, k) in cls.decoder_linear_shapes(hf_config).items()}

    @classmethod
    def input_embedding_scale(cls, hf_config: object) -> float:
        """The factor the token embeddings are multiplied by before the first decoder layer (Gemma:
        ``sqrt(hidden_size)``; 1 elsewhere). The quantizer's calibration applies it too."""
        return 1.0

    def set_max_model_len(self, max_model_len: int) -> None:
        """Fit the model to an engine whose sequences reach ``max_model_len`` tokens: every rotary table is
        cut to that many positions and the RoPE scalings that depend on the length (LongRoPE, dynamic NTK)
        are fixed for it (``layers/rope_scaling.py``). The model runner calls it once, before any forward."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.set_max_model_len(max_model_len)

    @property
    def has_lm_head(self) -> bool:
        """Whether the model still has its LM head (:meth:`drop_lm_head` removes it)."""
        return getattr(self, "lm_head", None) is not None

    def drop_lm_head(self) -> None:
        """Remove the LM head, before the weights load: a pooling (embedding) engine only reads the final hidden
        states (``forward``), so the head is neither loaded (a checkpoint without ``lm_head.weight`` loads) nor
        kept, and :meth:`compute_logits` is not available afterwards."""
        if "lm_head" in self._modules:
            del self._modules["lm_head"]
        self.lm_head = None

    def pack_for_cpu(self) -> None:
        """Prepack every fp32 CPU weight for the oneDNN GEMM (``layers/cpu_gemm.py``), in place;
        inference only, after loading and after ``layers.fusion.fuse_model``. Every layer with a
        ``pack_for_cpu()`` (the linears) is packed; the LM head (``self.lm_head``, dense or quantized)
        keeps a tied weight."""
        head = getattr(self, "lm_head", None)
        for module in self.modules():
            if module is head:
                module.pack_for_cpu(keep_weight=self.tie_word_embeddings)
            elif module is not self and callable(getattr(module, "pack_for_cpu", None)):
                module.pack_for_cpu()
