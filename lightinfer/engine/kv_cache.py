"""KVCacheSpec: the one description of the paged KV cache that kernels and engine share."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer: ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    INT8 adds ``k_scale, k_zero, v_scale, v_zero`` float16 ``[num_blocks, block_size,
    num_kv_heads]`` (per token, per head, asymmetric; see ``kernels/reference.py``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def is_int8(self) -> bool:
        return self.dtype == torch.int8

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (K and V, scales and zeros included)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        per_head = self.head_dim * elem + (2 * 2 if self.is_int8 else 0)  # + fp16 scale and zero
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate_layers(self, num_layers: int, num_blocks: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """Every layer's cache tensors as views of one zero-filled tensor per kind: one
        allocation each, whatever the layer count (see :meth:`allocate` for the layouts)."""
        whole = self.allocate(num_blocks * num_layers, device)
        return [{name: t[i * num_blocks: (i + 1) * num_blocks] for name, t in whole.items()}
                for i in range(num_layers)]

    def allocate(self, num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        """One layer's cache tensors (zero-filled).

        K/V are contiguous. The INT8 scale/zero tensors are ``[num_blocks, block_size,
        num_kv_heads]`` everywhere, but on a GPU they are head-major in memory (strides
        ``(heads * block_size, 1, block_size)``): the kernels read one head's tokens of a block
        together, and head-major makes those 16 x 2 bytes one 32-byte sector instead of 16
        scattered ones. The Triton kernels take any strides; the CPU path keeps them contiguous.
        """
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        out = {"k_cache": torch.zeros(shape, dtype=self.dtype, device=device),
               "v_cache": torch.zeros(shape, dtype=self.dtype, device=device)}
        if self.is_int8:
            head_major = torch.device(device).type == "cuda"
            for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
                if head_major:
                    out[name] = torch.zeros((num_blocks, self.num_kv_heads, self.block_size), dtype=torch.float16,
                                            device=device).transpose(1, 2)
                else:
                    out[name] = torch.zeros(shape[:3], dtype=torch.float16, device=device)
        return out
