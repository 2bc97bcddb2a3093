"""RoPE settings a GGUF file holds that transformers' GGUF config reader drops, put back into the config.

llama.cpp's converter writes Phi-3's LongRoPE as two small F32 tensors, ``rope_factors_long.weight`` and
``rope_factors_short.weight``, with the pretraining length in ``phi3.rope.scaling.original_context_length``,
and a partial rotation (Phi-4-mini: 96 of 128 dims) as ``phi3.rope.dimension_count``. transformers maps none
of them for phi3 (2026-12, ``integrations/ggml.py``), so a Phi-3-128k or Phi-4-mini GGUF would load with plain
full-width RoPE: right within 4k tokens of a 128k model, wrong past them, and wrong everywhere for Phi-4-mini.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from lightinfer.formats.gguf_header import GGUFHeader, TensorInfo


def _f32_tensor(header: GGUFHeader, info: TensorInfo) -> list[float]:
    """A small F32 tensor's values, read from the file at its offset."""
    if info.ggml_type != GGMLQuantizationType.F32:
        raise ValueError(f"{header.path}: tensor {info.name} is {info.ggml_type.name}; llama.cpp writes it as F32")
    return np.fromfile(header.path, dtype=np.float32, count=info.nbytes // 4, offset=info.offset).tolist()


def rope_overrides(header: GGUFHeader, arch: str) -> dict:
    """Config attributes to set for the file whose parsed header is ``header`` (``gguf_header.read_gguf_header``)
    of architecture ``arch``: ``{"rope_parameters": {...}, "original_max_position_embeddings": n,
    "partial_rotary_factor": f}``, those that apply (empty for other architectures).

    Raises:
        ValueError: a rope-factor tensor that is not F32.
    """
    if arch != "phi3":
        return {}
    out: dict = {}
    tensors = {t.name: t for t in header.tensors}
    dims, heads = header.get(f"{arch}.rope.dimension_count"), header.get(f"{arch}.attention.head_count")
    width = header.get(f"{arch}.embedding_length")
    if dims and heads and width and int(dims) < int(width) // int(heads):
        out["partial_rotary_factor"] = int(dims) / (int(width) // int(heads))
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        rope = {"rope_type": "longrope",
                "long_factor": _f32_tensor(header, tensors["rope_factors_long.weight"]),
                "short_factor": _f32_tensor(header, tensors["rope_factors_short.weight"])}
        original = header.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
            out["original_max_position_embeddings"] = int(original)
        attention = header.get(f"{arch}.rope.scaling.attn_factor")
        if attention:
            rope["attention_factor"] = float(attention)
        out["rope_parameters"] = rope
    return out


def apply_rope_overrides(config: object, overrides: dict) -> None:
    """Set :func:`rope_overrides`' result on a transformers config (its rope theta and partial factor kept)."""
    if not overrides:
        return
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "partial_rotary_factor" in overrides:
        config.partial_rotary_factor = overrides["partial_rotary_factor"]  # type: ignore[attr-defined]
        params["partial_rotary_factor"] = overrides["partial_rotary_factor"]
    if "original_max_position_embeddings" in overrides:
        config.original_max_position_embeddings = overrides["original_max_position_embeddings"]  # type: ignore
    if "rope_parameters" in overrides:
        params.update(overrides["rope_parameters"])
    config.rope_parameters = params  # type: ignore[attr-defined]
