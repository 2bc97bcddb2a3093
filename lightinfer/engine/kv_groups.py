"""KV-cache groups: which attention layers share block tables, and how big each group's pool is.

A group is the set of layers with one sliding window (or none: full attention). Group 0 is the
full-attention layers when the model has any, then one group per distinct window, smallest first. A window
at least ``max_model_len`` long never drops a token, so such layers join the full group. Why groups get
pools of their own: ``block_manager.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightinfer.engine.memory import KVGroupNeed, sliding_window_blocks
from lightinfer.kernels import KVCacheSpec
from lightinfer.layers.attention import Attention


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group.

    Attributes:
        window: the sliding window in tokens; None for full attention.
        layers: indices of its layers in the model's attention layers (in model order).
        spec: its layers' cache (``num_layers`` = ``len(layers)``).
    """

    window: int | None
    layers: tuple[int, ...]
    spec: KVCacheSpec

    @property
    def name(self) -> str:
        kind = f"sliding window {self.window}" if self.window else "full attention"
        return f"{kind}, {len(self.layers)} layer{'s' if len(self.layers) != 1 else ''}"

    def need(self, max_model_len: int, chunk_tokens: int) -> KVGroupNeed:
        """What one ``max_model_len`` sequence holds in this group at most (``chunk_tokens``: one step's tokens)."""
        blocks = self.spec.blocks_for(max_model_len)
        if self.window:
            blocks = min(blocks, sliding_window_blocks(self.window, chunk_tokens, self.spec.block_size))
        return KVGroupNeed(self.name, self.spec.bytes_per_block, blocks)


def kv_groups_of(layers: list[Attention], max_model_len: int, block_size: int, dtype: object) -> list[KVGroup]:
    """Group ``layers`` by window (module docstring) and give each layer its group (``Attention.kv_group``).

    Raises:
        ValueError: layers of different KV head counts or head sizes (one KV layout per engine).
    """
    shapes = {(a.num_kv_heads, a.head_dim) for a in layers}
    if len(shapes) != 1:
        raise ValueError(f"attention layers with different KV shapes {sorted(shapes)} (kv heads, head_dim) are not "
                         f"supported")
    num_kv_heads, head_dim = shapes.pop()
    groups = kv_groups_for_windows([a.sliding_window for a in layers], num_kv_heads, head_dim, max_model_len,
                                   block_size, dtype)
    for g, group in enumerate(groups):
        for i in group.layers:
            layers[i].kv_group = g
    return groups


def kv_groups_for_windows(windows: list[int | None], num_kv_heads: int, head_dim: int, max_model_len: int,
                          block_size: int, dtype: object) -> list[KVGroup]:
    """The KV-cache groups of a model whose attention layers have these sliding ``windows`` (None: full
    attention), in order, without building anything (what ``fit`` plans with)."""
    windows = [w if w and w < max_model_len else None for w in windows]
    order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return [KVGroup(window, members, KVCacheSpec(len(members), num_kv_heads, head_dim, block_size, dtype))
            for window in order for members in (tuple(i for i, w in enumerate(windows) if w == window),)]
