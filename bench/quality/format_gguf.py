"""GGUF files of the embedded SmolLM2 in other block types, for ``bench/quality/format_quality.py``.

The embedded file is Q4_1 (its 210 linears; the token embedding is Q8_0, the norms F32). A variant keeps
the metadata, the embedding and the norms byte for byte and re-encodes each Q4_1 linear from its
dequantized fp32 weights (the ``gguf`` package's own dequantizer) into another type:

  q4_0   every linear Q4_0 (the ``gguf`` package's quantizer)
  q8_0   every linear Q8_0 (the ``gguf`` package's quantizer)
  q4_k   Q4_K where the row holds whole super-blocks of 256 (SmolLM2: ffn_down, K = 1536), Q5_0 elsewhere
         (K = 576 is not a multiple of 256): llama.cpp's own fallback for Q4_K, so this is what a
         SmolLM2 "Q4_K" file holds. The ``gguf`` package has no Q4_K quantizer (0.19: NotImplementedError);
         :func:`quantize_q4_k` below is a plain min-max one (its output is checked against the package's
         Q4_K *dequantizer* by the caller's reference, which is all the comparison needs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

VARIANTS = ("q4_0", "q4_k", "q8_0")


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w`` float32 ``[rows, cols]`` (cols a multiple of 256) as Q4_K blocks, uint8 ``[rows, cols/256*144]``.

    Per sub-block of 32: min-max range ``[min(0, lo), hi]`` -> scale ``(hi - lo)/15`` and min ``-lo``; the 8
    scales and mins of a super-block are stored as 6-bit multiples of fp16 ``d`` / ``dmin``.
    Block = d (fp16), dmin (fp16), scales[12] (6-bit pairs, ggml's packing), qs[128] (two sub-blocks per
    32 bytes: low nibble = sub-block 2c, high nibble = 2c+1).
    """
    rows, cols = w.shape
    if cols % 256:
        raise ValueError(f"Q4_K needs rows of whole 256-element super-blocks, got {cols} columns")
    x = w.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = np.maximum(x.max(axis=-1), lo)
    scale, mins = (hi - lo) / 15.0, -lo  # [rows, nb, 8]
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    mm = np.clip(np.rint(np.divide(mins, dmin32, out=np.zeros_like(mins), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    zero = (dmin32 * mm)[..., None]
    q = np.clip(np.rint(np.divide(x + zero, step, out=np.zeros_like(x), where=step > 0)), 0, 15).astype(np.uint8)
    packed_sc = np.empty((rows, cols // 256, 12), np.uint8)
    packed_sc[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed_sc[..., 4:8] = mm[..., :4] | ((mm[..., 4:] >> 4) << 6)
    packed_sc[..., 8:12] = (sc[..., 4:] & 0xF) | ((mm[..., 4:] & 0xF) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, cols // 256, 128)
    block = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed_sc, qs], axis=-1)
    return block.reshape(rows, -1)


def _target(variant: str, cols: int) -> T:
    if variant == "q4_0":
        return T.Q4_0
    if variant == "q8_0":
        return T.Q8_0
    if variant == "q4_k":
        return T.Q4_K if cols % 256 == 0 else T.Q5_0
    raise ValueError(f"unknown GGUF variant {variant!r}; choose from {VARIANTS}")


def write_variant(src: Path, dst: Path, variant: str) -> dict[str, int]:
    """Write ``dst``: ``src`` with every Q4_1 tensor re-encoded per ``variant``. Returns {type name: count}."""
    reader = GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes the header and the architecture itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        data, raw = np.asarray(t.data), t.tensor_type
        if t.tensor_type == T.Q4_1:
            w = dequantize(data, T.Q4_1)  # float32 [rows, cols]
            raw = _target(variant, w.shape[1])
            data = quantize_q4_k(w) if raw == T.Q4_K else quantize(w, raw)
        counts[raw.name] = counts.get(raw.name, 0) + 1
        writer.add_tensor(t.name, data, raw_dtype=None if raw in (T.F32, T.F16) else raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def gguf_reference_model(path: Path):  # type: ignore[no-untyped-def]
    """The GGUF dequantized by transformers' GGUF reader (the ``gguf`` package's dequantizers), fp32 dense: the
    transformers baseline of the CPU benchmarks. ``lightinfer.loader._read_gguf`` is that reader's documented
    wrapper (the oracle of the tests and benchmarks)."""
    from bench.quality.format_ref import dense_model
    from lightinfer.loader import _read_gguf

    config, tensors = _read_gguf(str(path))
    return dense_model(config, tensors)
