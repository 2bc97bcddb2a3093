"""The paged KV cache: :class:`KVCacheSpec` describes it, :class:`PagedKV` is one layer's tensors.

Layout, per layer::

    k, v                          [num_blocks, block_size, num_kv_heads, head_dim]  float or int8
    k_scale, k_zero,              [num_blocks, block_size, num_kv_heads]            float16, INT8 only
    v_scale, v_zero

    slot s = block s // block_size, offset s % block_size
    INT8: per token and head, asymmetric: x ~= q * scale + zero, q in [-128, 127]
          (computed when the token is written: ``reference.quantize_kv_int8``)

The engine, the layers, the Triton launchers and their twins all pass one :class:`PagedKV` per layer;
its layout is checked once, when it is made. Torch only (no Triton import).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .launch_utils import FLOAT_DTYPES

KV_BLOCK_SIZES = (8, 16, 32)  # tokens per KV block the engine accepts; the kernels' audit compiles each
SCALE_NAMES = ("k_scale", "k_zero", "v_scale", "v_zero")


@dataclass(frozen=True)
class PagedKV:
    """One layer's paged KV cache (module docstring), written and read in place by the kernels.

    Attributes:
        k, v: ``[num_blocks, block_size, num_kv_heads, head_dim]`` fp16/bf16/fp32 or int8, one dtype, equal
            strides, stride 1 on head_dim.
        k_scale, k_zero, v_scale, v_zero: float16 ``[num_blocks, block_size, num_kv_heads]`` with one set of
            strides (any: the engine's are head-major on GPUs, see :meth:`KVCacheSpec.allocate`); required
            for an int8 cache, None otherwise.

    Raises:
        ValueError: on construction, for any layout above not met (the message names what is wrong).
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k, v = self.k, self.v
        if k.dim() != 4 or v.shape != k.shape or k.stride() != v.stride():
            raise ValueError(f"PagedKV: k and v must be [num_blocks, block_size, num_kv_heads, head_dim] with equal "
                             f"strides, got {tuple(k.shape)} / {tuple(v.shape)}")
        if k.stride(3) != 1 or k.dtype != v.dtype:
            raise ValueError(f"PagedKV: k and v need one dtype and stride 1 on head_dim, got {k.dtype}/{v.dtype}, "
                             f"stride {k.stride(3)}")
        if k.dtype != torch.int8 and k.dtype not in FLOAT_DTYPES:
            raise ValueError(f"PagedKV: cache dtype {k.dtype} not in fp16/bf16/fp32/int8")
        scales = self.scales
        if k.dtype == torch.int8:
            want = k.shape[:3]
            if any(t is None or t.shape != want or t.dtype != torch.float16 for t in scales) or \
                    len({t.stride() for t in scales}) != 1:
                raise ValueError(f"PagedKV: an int8 cache needs float16 k_scale, k_zero, v_scale, v_zero of shape "
                                 f"{tuple(want)}, all four with the same strides")
        elif any(t is not None for t in scales):
            raise ValueError(f"PagedKV: a {k.dtype} cache takes no scales or zeros (only an int8 cache has them)")
        if len({t.device for t in self.tensors()}) != 1:
            raise ValueError(f"PagedKV: all tensors must be on one device, got {[str(t.device) for t in self.tensors()]}")

    @property
    def is_int8(self) -> bool:
        """Whether K/V are INT8 codes with per-token scales and zeros."""
        return self.k.dtype == torch.int8

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, k_zero, v_scale, v_zero)``: four None for a float cache."""
        return self.k_scale, self.k_zero, self.v_scale, self.v_zero

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this cache holds by field name (``k``, ``v`` and for INT8 the four scales/zeros)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this cache holds, in field order."""
        return list(self.named_tensors().values())

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` (int64 ``[n]`` on this cache's device) in every tensor: the
        copy-on-write of a shared partial block. ``dst`` must not repeat or overlap ``src``."""
        for t in self.tensors():
            t[dst] = t[src]


@dataclass(frozen=True)
class KVCacheSpec:
    """What the engine's KV pool is made of (module docstring for the layout).

    Attributes:
        num_layers: attention layers (one :class:`PagedKV` each).
        num_kv_heads, head_dim: per layer.
        block_size: tokens per block, one of :data:`KV_BLOCK_SIZES` for the engine.
        dtype: K/V element type; ``torch.int8`` adds the float16 scales and zeros.
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
        """Blocks that hold ``num_tokens`` tokens."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate_layers(self, num_layers: int, num_blocks: int, device: torch.device) -> list[PagedKV]:
        """``num_layers`` caches of ``num_blocks`` blocks, each tensor kind one zero-filled allocation whatever
        the layer count, every layer's tensors contiguous views of it (see :meth:`allocate` for the layouts).
        Per-layer tensors would each be rounded up by the CUDA caching allocator (up to 2 MiB x 6 x layers)."""
        whole = self.allocate(num_blocks * num_layers, device).named_tensors()
        return [PagedKV(**{name: t[i * num_blocks: (i + 1) * num_blocks] for name, t in whole.items()})
                for i in range(num_layers)]

    def allocate(self, num_blocks: int, device: torch.device) -> PagedKV:
        """One layer's cache (zero-filled).

        K/V are contiguous. The INT8 scale/zero tensors are ``[num_blocks, block_size,
        num_kv_heads]`` everywhere, but on a GPU they are head-major in memory (strides
        ``(heads * block_size, 1, block_size)``): the kernels read one head's tokens of a block
        together, and head-major makes those 16 x 2 bytes one 32-byte sector instead of 16
        scattered ones. The Triton kernels take any strides; the CPU path keeps them contiguous.
        """
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        k = _zeros(shape, self.dtype, device)
        v = _zeros(shape, self.dtype, device)
        if not self.is_int8:
            return PagedKV(k, v)
        head_major = torch.device(device).type == "cuda"
        scales = {}
        for name in SCALE_NAMES:
            if head_major:
                scales[name] = torch.zeros((num_blocks, self.num_kv_heads, self.block_size), dtype=torch.float16,
                                           device=device).transpose(1, 2)
            else:
                scales[name] = _zeros(shape[:3], torch.float16, device)
        return PagedKV(k, v, **scales)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on a CPU an anonymous memory map, whose pages the kernel zeroes when first touched: a KV pool
    takes memory (RSS) as its blocks fill, not all at start-up, and start-up skips a memset of the whole pool
    (512 MiB by default on a CPU). Not numpy's ``calloc``: numpy asks for transparent huge pages on large
    arrays, and with the kernel's default ``defrag=madvise`` each first touch of one may stop to compact
    memory (measured: writing 512 MiB of blocks took 3.8 s that way, 0.5 s from a plain map, 0.13 s
    prefaulted). Same values as ``torch.zeros``."""
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap
    import warnings

    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the map alive
    with warnings.catch_warnings():  # a memory map is writable; torch warns for any buffer it cannot tell
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape)
