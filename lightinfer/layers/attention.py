"""Attention over the paged KV cache, and the per-step metadata the model runner sets.

The model sees only ``(input_ids, positions)``; everything else about the batch lives in the
:class:`AttentionMetadata` set with :func:`set_context` (the nano-vllm pattern), so model files
stay free of engine details.

A batch is flat: ``[decode tokens | prefill tokens]``. Decodes (one new token per sequence)
come first and use the decode kernel; the rest are (chunks of) prompts and use the prefill
kernel, which attends to cached prefix blocks plus the new tokens.

KV-cache groups: a model whose layers differ in how much context they keep (Gemma's sliding-window
local layers beside global ones) has one KV pool per group, so each group has its own block tables and
slot mapping (``engine/block_manager.py`` says why). Group 0's are :class:`AttentionMetadata`'s own
fields; the others are in ``other_groups``. Each :class:`Attention` knows its group (``kv_group``, set
by the model runner with the cache).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lightinfer.kernels import PagedKV, SplitKPartials
from lightinfer.layers.ops import backend_name, ops_for
from lightinfer.layers.rope_scaling import layer_types_of
from lightinfer.layers.rotary import RotaryEmbedding


@dataclass
class KVGroupTables:
    """One KV-cache group's tables for a step (groups after the first; see the module docstring).

    Attributes:
        slot_mapping: int64 ``[num_tokens]`` the token's slot in this group's pool (-1: padding).
        block_tables: int32 ``[num_seqs, max_num_blocks]`` this group's blocks per sequence, -1 padded (and
            -1 where a sliding-window group freed a block the window has passed).
        num_decodes: as :attr:`AttentionMetadata.num_decodes`.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int = 0

    @functools.cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """``block_tables[:num_decodes]``, one object per step (see ``AttentionMetadata``)."""
        return self.block_tables[: self.num_decodes]


@dataclass
class AttentionMetadata:
    """One step's batch description.

    Attributes:
        num_decodes: sequences (= tokens) at the front of the batch that are decodes.
        slot_mapping: int64 ``[num_tokens]`` cache slot of each token (-1: padding).
        context_lens: int32 ``[num_seqs]`` tokens in the cache per sequence after this step.
        block_tables: int32 ``[num_seqs, max_num_blocks]``, -1 padded.
        cu_seqlens_q: int32 ``[num_prefills + 1]`` offsets of the prefill sequences' new tokens,
            relative to the first prefill token.
        no_cache: attend within the batch only (calibration / profiling), ``cu_seqlens_q``
            covering every sequence.
        other_groups: KV-cache groups 1.. (module docstring); ``slot_mapping`` and ``block_tables``
            above are group 0's.
    """

    num_decodes: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    no_cache: bool = False
    other_groups: tuple[KVGroupTables, ...] = ()

    def group(self, index: int) -> AttentionMetadata | KVGroupTables:
        """KV-cache group ``index``'s tables: an object with ``slot_mapping``, ``block_tables`` and
        ``decode_block_tables`` (this metadata itself for group 0).

        Raises:
            RuntimeError: the step carries no tables for that group (a model/engine mismatch).
        """
        if index == 0:
            return self
        if index - 1 >= len(self.other_groups):
            raise RuntimeError(f"attention layer of KV-cache group {index}, but the step has tables for "
                               f"{1 + len(self.other_groups)} group(s)")
        return self.other_groups[index - 1]

    @functools.cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """``block_tables[:num_decodes]``, one object for every layer of the step (the CPU decode
        caches its per-step plan on it)."""
        return self.block_tables[: self.num_decodes]

    @functools.cached_property
    def decode_context_lens(self) -> torch.Tensor:
        """``context_lens[:num_decodes]``, one object per step (see ``decode_block_tables``)."""
        return self.context_lens[: self.num_decodes]


def sliding_window_of(hf_config: object, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx`` of a transformers config (its ``layer_types`` entry is
    ``"sliding_attention"``, or the config has a window and no layer types: Mistral, Phi-3); None = full."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or layer_types_of(hf_config)[layer_idx] != "sliding_attention":
        return None
    return int(window)


_CONTEXT: AttentionMetadata | None = None


def set_context(metadata: AttentionMetadata | None) -> None:
    """Install the metadata the next forward reads (None clears it)."""
    global _CONTEXT
    _CONTEXT = metadata


def get_context() -> AttentionMetadata:
    """The current metadata. Raises RuntimeError when no forward context is set."""
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a forward context: set_context(...) first")
    return _CONTEXT


@contextlib.contextmanager
def no_cache_context(cu_seqlens: torch.Tensor) -> Iterator[None]:
    """Run layers without a KV cache: causal attention inside each of the sequences that
    ``cu_seqlens`` (int32 ``[num_seqs + 1]``) cuts the flat batch into."""
    previous = _CONTEXT
    set_context(AttentionMetadata(cu_seqlens_q=cu_seqlens, no_cache=True))
    try:
        yield
    finally:
        set_context(previous)


class Attention(nn.Module):
    """Scaled dot-product attention over the paged KV cache (GQA-aware).

    The model runner binds ``kv_cache``, this layer's :class:`~lightinfer.kernels.PagedKV`, after
    allocating the pool (``kernels/paged_kv.py`` for the layout), and sets ``kv_group``, the KV-cache
    group whose tables the layer reads (module docstring); without a cache (None) the layer attends
    within the batch only.

    Args:
        num_heads, head_dim, scale, num_kv_heads: the attention's shape and softmax scale.
        sliding_window: the layer sees only the last ``sliding_window`` tokens (itself included); None = all.
        softcap: tanh soft-capping of the scaled scores, ``softcap * tanh(s / softcap)`` (Gemma 2); None = none.
    """

    accepts_split_k_partials = True  # forward_qkv sums a fused qkv GEMM's partials (layers/fusion.py)

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.softcap = float(softcap) if softcap else None
        self.kv_cache: PagedKV | None = None
        self.kv_group = 0

    @property
    def _window_args(self) -> dict:
        """The kernels' ``window`` / ``softcap`` keyword arguments (only those this layer uses)."""
        args: dict = {}
        if self.sliding_window:
            args["window"] = self.sliding_window
        if self.softcap:
            args["softcap"] = self.softcap
        return args

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` -> ``[T, H * D]``."""
        ctx = get_context()
        ops = ops_for(q)
        if ctx.no_cache or self.kv_cache is None:
            assert ctx.cu_seqlens_q is not None, "no KV cache bound and no cu_seqlens to attend within"
            out = ops.varlen_causal_attention(q, k, v, ctx.cu_seqlens_q, self.scale, **self._window_args)
            return out.reshape(q.shape[0], -1)
        ops.store_kvcache(k, v, self.kv_cache, ctx.group(self.kv_group).slot_mapping)
        return self._attend(q, self.kv_cache, ctx)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor | SplitKPartials,
                    rotary_emb: RotaryEmbedding) -> torch.Tensor:
        """From a fused qkv projection's output: RoPE, then :meth:`forward`.

        With a KV cache bound, one op (``rope_store_kvcache``) sums split-K partials, rotates q and k
        and writes k and v into the cache, where the reduction, ``rotary_qk`` and ``store_kvcache``
        were three launches per layer.

        Args:
            positions: ``[T]`` token positions.
            qkv: ``[T, (H + 2 Hkv) * D]`` (q | k | v), or a W4A16 GEMM's :class:`SplitKPartials` of it.
            rotary_emb: the model's rotary table.
        Returns:
            ``[T, H * D]``.
        """
        ctx = get_context()
        x = qkv.partials if isinstance(qkv, SplitKPartials) else qkv
        # the fused op rotates whole heads, but for the CPU's (cpu_fused / cpu_native.rope_store: partial too)
        if ctx.no_cache or self.kv_cache is None or (rotary_emb.is_partial and backend_name(x) != "torch_cpu"):
            q, k, v = self.split_qkv(qkv.reduced() if isinstance(qkv, SplitKPartials) else qkv)
            q, k = rotary_emb(positions, q, k)
            return self.forward(q, k, v)
        q = ops_for(x).rope_store_kvcache(positions, qkv, self.num_heads, self.num_kv_heads, rotary_emb.cos_cache,
                                          rotary_emb.sin_cache, self.kv_cache, ctx.group(self.kv_group).slot_mapping)
        return self._attend(q, self.kv_cache, ctx)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused projection's ``[T, (H + 2 Hkv) * D]`` -> views q ``[T, H, D]``, k, v ``[T, Hkv, D]``."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d), v.reshape(t, self.num_kv_heads, d)

    def _attend(self, q: torch.Tensor, kv: PagedKV, ctx: AttentionMetadata) -> torch.Tensor:
        """q ``[T, H, D]`` against the cache (this step's k/v already in it) -> ``[T, H * D]``."""
        ops = ops_for(q)
        nd = ctx.num_decodes
        tables = ctx.group(self.kv_group)
        extra = self._window_args
        if nd == q.shape[0]:  # a decode-only step: no output buffer to scatter into
            return ops.paged_attention_decode(q, kv, tables.decode_block_tables, ctx.decode_context_lens,
                                              self.scale, **extra).reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = ops.paged_attention_decode(q[:nd], kv, tables.decode_block_tables, ctx.decode_context_lens,
                                                  self.scale, **extra)
        if nd < q.shape[0]:
            out[nd:] = ops.paged_attention_prefill(q[nd:], kv, ctx.cu_seqlens_q, ctx.context_lens[nd:],
                                                   tables.block_tables[nd:], self.scale, **extra)
        return out.reshape(q.shape[0], -1)
