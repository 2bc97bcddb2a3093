"""lightinfer: quantization-first LLM inference (AWQ W4A16 weights, INT8 paged KV cache).

Public names: :class:`LLM`, :class:`SamplingParams`, :func:`pipeline`, :func:`quantize`.
"""

from __future__ import annotations

from lightinfer.llm import LLM, pipeline
from lightinfer.outputs import CompletionOutput, RequestOutput
from lightinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "pipeline", "quantize", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def quantize(src: str, out: str, config: object = None) -> object:
    """Quantize ``src`` into an AWQ checkpoint at ``out``; see :func:`lightinfer.quant.api.quantize`."""
    from lightinfer.quant.api import quantize as _quantize

    return _quantize(src, out, config)
