"""Helpers shared by the Triton launchers: argument checks and compile specs.

Every launcher describes each (kernel, constexprs, num_warps, num_stages) it can launch
as a :class:`LaunchSpec`; ``kernels/smem_check.py`` compiles exactly those for a
consumer-card target to prove they fit its shared memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

# Triton 3.9 warns at every process's first compile that its FP-fusion default may change; pin today's
# default (fused multiply-adds on: what every figure and tolerance here was measured with) unless the user chose.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# Triton signature strings for the element types the launchers accept.
TRITON_DTYPE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LaunchSpec:
    """One compiled variant of a kernel: what ``triton.compile(ASTSource(...))`` needs.

    ``signature`` maps every argument name to a Triton type string (``"*fp16"``, ``"i32"``,
    ``"constexpr"``); ``constexprs`` gives the value of each ``constexpr`` argument.
    """

    name: str
    kernel: Any  # the @triton.jit function (a JITFunction when not interpreting)
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = 1
    tags: dict[str, Any] = field(default_factory=dict)


@dataclass
class SplitKPartials:
    """A W4A16 GEMM's split-K output not yet reduced: ``y = (partials.sum(0) + bias).to(dtype)``.

    ``partials`` fp32 ``[S, M, N]``; ``bias`` ``[N]`` or None; ``dtype`` is y's. The ops that take
    a GEMM's output (``fused_add_rms_norm``, ``silu_and_mul``) sum the splits as they load it,
    which saves the reduction kernel's launch; :meth:`reduced` gives y for anything else.
    """

    partials: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """``[M, N]``, the shape of y."""
        return self.partials.shape[1:]

    @property
    def is_cuda(self) -> bool:
        return self.partials.is_cuda

    @property
    def device(self) -> torch.device:
        return self.partials.device

    def reduced(self) -> torch.Tensor:
        """y in plain PyTorch, summing the splits in order like the reduction kernel."""
        acc = self.partials[0].clone()
        for s in range(1, self.partials.shape[0]):
            acc += self.partials[s]
        if self.bias is not None:
            acc += self.bias.to(torch.float32)
        return acc.to(self.dtype)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands of ``dtype`` must be fed as fp32.

    Only on the CPU interpreter and only for bf16: Triton 3.9's interpreter returns garbage
    (~1e10) for a bf16 x bf16 ``tl.dot``. On a GPU this is always False.
    """
    return interpreting() and dtype == torch.bfloat16


def check_device(name: str, *tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device, which Triton can run on.

    Raises:
        ValueError: tensors on different devices, or on CPU without ``TRITON_INTERPRET=1``.
    """
    present = [t for t in tensors if t is not None]
    dev = present[0].device
    for t in present[1:]:
        if t.device != dev:
            raise ValueError(f"{name}: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and not (dev.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name}: tensors on {dev}; the Triton kernels need CUDA (or CPU with TRITON_INTERPRET=1). "
            "Use lightinfer.kernels.reference on CPU."
        )
    return dev


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 on the CPU interpreter, to keep grids small)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_cache_dtype(name: str, k_cache: torch.Tensor, aux: tuple) -> bool:
    """Whether ``k_cache`` is INT8; then ``aux`` must be its float16 ``(k_scale, k_zero, v_scale, v_zero)``
    ``[num_blocks, block_size, num_kv_heads]``, all four with the same strides.

    Raises:
        ValueError: naming ``name``, for missing or misshapen scales/zeros or a cache dtype outside
            fp16/bf16/fp32/int8.
    """
    quant = k_cache.dtype == torch.int8
    if quant:
        want = k_cache.shape[:3]
        if any(t is None or t.shape != want or t.dtype != torch.float16 for t in aux) or \
                len({t.stride() for t in aux}) != 1:
            raise ValueError(f"{name}: an int8 cache needs float16 k_scale, k_zero, v_scale, v_zero of shape "
                             f"{tuple(want)}, all four with the same strides")
    elif k_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: cache dtype {k_cache.dtype} not in fp16/bf16/fp32/int8")
    return quant
