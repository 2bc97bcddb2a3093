"""Host-side helpers every Triton launcher shares: dtypes, device checks, sizes, compile options.

Nothing here imports Triton: the engine's planning code (``attention_plan``) and the CPU backends use
these without paying Triton's import.
"""

from __future__ import annotations

import os
from typing import Any

import torch

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

# Compile options every launch passes (and the audit's compiles: ``audit/compile.py``). Fused multiply-adds
# on: what every figure and tolerance here was measured with. Passed explicitly rather than left to Triton's
# default, which Triton 3.9 warns will change in 3.10 (``TRITON_DEFAULT_FP_FUSION``): no process-wide
# environment is set for it. The CPU interpreter ignores it.
COMPILE_OPTIONS: dict[str, Any] = {"enable_fp_fusion": True}


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``, Triton's own variable:
    read each time, since Triton itself reads it when a kernel module is imported)."""
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
            "Use the torch_cpu or reference backend on CPU (lightinfer.kernels.get_backend)."
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


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``triton.cdiv`` without importing Triton)."""
    return -(-a // b)


def as_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x [..., H]`` -> a 2-D ``[rows, H]`` view with stride 1 on H (a copy only if the rows cannot be viewed).

    Raises:
        ValueError: ``x`` is not a float tensor with at least one dimension.
    """
    if x.dtype not in FLOAT_DTYPES or x.dim() < 1:
        raise ValueError(f"{name}: expected a float tensor [..., H], got {x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
