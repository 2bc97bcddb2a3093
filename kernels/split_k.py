"""A W4A16 GEMM's split-K output left unreduced (:class:`SplitKPartials`), and how launchers pass it on.

Ops that take a GEMM's output (``fused_add_rms_norm``, ``silu_and_mul``, ``rope_store_kvcache``) accept
either a tensor or :class:`SplitKPartials`; their kernels sum the splits as they load them
(``split_k_jit.load_input``), which saves the reduction kernel's launch. Torch only: layers and models
use the class without importing Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .launch_utils import as_rows


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


def split_k_args(name: str, x: torch.Tensor | SplitKPartials) -> tuple[torch.Tensor, tuple, dict[str, Any]]:
    """``x`` for a kernel that loads it with ``split_k_jit.load_input``: the 2-D rows tensor behind ``x_ptr``,
    the positional ``(xb_ptr, stride_split, num_splits)`` and the ``SPLITS``/``SPLIT_BIAS`` constexprs
    (none for a plain tensor: the kernels default them to False).

    Raises:
        ValueError: naming ``name``, for partials that are not contiguous fp32 ``[S, M, N]`` or a bias not ``[N]``,
            or a plain ``x`` that is not float.
    """
    if isinstance(x, SplitKPartials):
        p = x.partials
        if p.dim() != 3 or p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"{name}: split-K partials must be contiguous fp32 [S, M, N], got {tuple(p.shape)} "
                             f"{p.dtype}")
        if x.bias is not None and x.bias.shape != (p.shape[2],):
            raise ValueError(f"{name}: split-K bias {tuple(x.bias.shape)} must be [{p.shape[2]}]")
        xb = x.bias if x.bias is not None else p
        return p[0], (xb, p.stride(0), p.shape[0]), {"SPLITS": True, "SPLIT_BIAS": x.bias is not None}
    x2 = as_rows(name, x)
    return x2, (x2, 0, 1), {}
