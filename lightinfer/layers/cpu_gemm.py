"""Prepacked fp32 GEMM for the CPU path (oneDNN, which the x86 and aarch64 torch wheels ship).

``F.linear`` hands the weight to the BLAS in its plain ``[out, in]`` layout on every call, and
the BLAS re-blocks it each time. Reordering each weight once into oneDNN's blocked layout, at
load time, makes the engine's linears 1.2-3x faster on CPU (measured on 2 AVX-512 cores with
SmolLM2's shapes: the 49152x576 LM head at 64 rows 37 -> 19 ms, 576->3072 at 8 rows 0.46 ->
0.16 ms). The ops are ``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``,
the pair torch's own compiler uses for the same purpose. They are not a documented API, so
:func:`onednn_gemm_available` checks them once against ``F.linear`` and the layers fall back
to ``F.linear`` when they are missing or disagree.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from lightinfer.kernels import switches

logger = logging.getLogger("lightinfer")

# oneDNN picks its blocking for this many rows; decode batches are 1..max_num_seqs and prefill
# chunks up to max_num_batched_tokens, and hints of 64 and 2048 measured the same at every M.
PACK_BATCH_HINT = 64


@functools.lru_cache(maxsize=1)
def onednn_gemm_available() -> bool:
    """Whether the prepacked fp32 GEMM exists here and matches ``F.linear`` (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=gen)
        x = torch.randn(5, 40, generator=gen)
        b = torch.randn(24, generator=gen)
        y = PackedWeight(w)(x, b)
        ok = bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError) as e:  # op missing or unsupported on this CPU
        logger.debug("oneDNN prepacked GEMM unavailable: %s", e)
        return False
    if not ok:
        logger.warning("oneDNN prepacked GEMM disagrees with F.linear here; using F.linear")
    return ok


def use_cpu_lowbit(activation_dtype: torch.dtype) -> bool:
    """Whether 4-/8-bit layers with ``activation_dtype`` activations stay low-bit on a CPU: for 16-bit
    activations (torch's int4 GEMM takes bf16; fp32 activations keep the exact dequantized path) unless the
    ``cpu_lowbit`` switch (``LIGHTINFER_CPU_LOWBIT=0``) says otherwise."""
    return activation_dtype in (torch.bfloat16, torch.float16) and switches.current().cpu_lowbit


def can_pack(weight: torch.Tensor) -> bool:
    """True for an fp32 CPU weight when the prepacked GEMM works on this machine."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_gemm_available()


class PackedWeight:
    """An fp32 ``[out, in]`` weight reordered once into oneDNN's blocked layout.

    Calling it computes ``x [..., in] @ W^T + bias -> [..., out]`` (fp32), like ``F.linear``.
    The packed tensor is opaque (layout ``torch._mkldnn``) and the same size as the weight.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), self.packed, bias,
                                               "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (fp32)."""
        return self.out_features * self.in_features * 4
