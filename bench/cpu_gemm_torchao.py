"""torchao's CPU candidates for bench/cpu_gemm.py; imported only inside ``.peers/torchao-venv``.

Each config quantizes an ``nn.Linear`` holding the fp32 weight with torchao's own scheme; the
candidate's reference weight is the quantized tensor dequantized (the fp32 weight where the tensor
cannot dequantize, as ``Int4OpaqueTensor``; its "own" error then includes quantization). Checked with torchao 0.18 on
torch 2.13 (CPU wheel): its PyPI wheel ships CUDA extensions only, so the layouts that need
torchao's own CPU kernels (``Int8DynamicActivationIntxWeightConfig`` with an ``opaque_torchao_*``
packing) are attempted and, when their ops are missing, reported as skipped.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from cpu_gemm_candidates import Candidate, Quant4


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a (possibly subclass) weight: the sum of its inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
    return t.numel() * t.element_size()


def _config(dotted: str, **kwargs: Any) -> Callable[[], Any]:
    """A config factory resolved at build time, so a missing class is a skip, not an import error."""

    def make() -> Any:
        module, name = dotted.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)(**kwargs)

    return make


def torchao_candidate(make_config: Callable[[], Any], dtype: torch.dtype) -> Callable[[torch.Tensor, Quant4], Candidate]:
    """``quantize_`` an ``nn.Linear(K, N)`` in ``dtype`` with the config; the call casts x to ``dtype``."""

    def build(w: torch.Tensor, q4: Quant4) -> Candidate:
        from torchao.quantization import quantize_

        n, k = w.shape
        lin = torch.nn.Linear(k, n, bias=False, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w.to(dtype))
        quantize_(lin, make_config())
        lin.requires_grad_(False)
        weight = lin.weight
        if type(weight) in (torch.Tensor, torch.nn.Parameter):
            raise RuntimeError("torchao left the weight unquantized (shape or layout not supported)")
        try:
            ref = weight.dequantize().float()
        except (NotImplementedError, AttributeError, RuntimeError):  # Int4OpaqueTensor cannot: own error = vs fp32
            ref = w

        def fn(x: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return lin(x.to(dtype))

        fn(torch.zeros(1, k))  # ops missing on this CPU fail here, at build time
        return Candidate(fn, _tensor_bytes(weight), ref)

    return build


def builders(group_size: int) -> list[tuple[str, Callable[[torch.Tensor, Quant4], Candidate]]]:
    """torchao's CPU-capable configs, in table order: (name, builder)."""
    q = "torchao.quantization"
    g = group_size
    import torchao.quantization.granularity as gran

    per_group = gran.PerGroup(g)
    return [
        (f"torchao int4 opaque CPU g{g} (bf16)",
         torchao_candidate(_config("torchao.prototype.quantization.int4.inference_workflow.PrototypeInt4WeightOnlyConfig",
                                   group_size=g), torch.bfloat16)),
        ("torchao int8 weight-only (fp32)", torchao_candidate(_config(f"{q}.Int8WeightOnlyConfig"), torch.float32)),
        ("torchao int8 weight-only (bf16)", torchao_candidate(_config(f"{q}.Int8WeightOnlyConfig"), torch.bfloat16)),
        ("torchao int8 dyn act + int8 weight (fp32)",
         torchao_candidate(_config(f"{q}.Int8DynamicActivationInt8WeightConfig"), torch.float32)),
        (f"torchao int8 dyn act + int4 weight g{g}, unpacked (fp32)",
         torchao_candidate(_config(f"{q}.Int8DynamicActivationIntxWeightConfig", weight_dtype=torch.int4,
                                   weight_granularity=per_group), torch.float32)),
        (f"torchao int8 dyn act + int4 weight g{g}, opaque_torchao_auto (fp32)",
         torchao_candidate(_config(f"{q}.Int8DynamicActivationIntxWeightConfig", weight_dtype=torch.int4,
                                   weight_granularity=per_group, intx_packing_format="opaque_torchao_auto"),
                           torch.float32)),
    ]
