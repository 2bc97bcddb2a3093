"""A GGUF file opened for loading: header checked, tensors indexed by Hugging Face name, raw blocks read
one tensor at a time.

* The header and tensor table are parsed once (``gguf_header.py``); a file shorter than its tensor
  table says (a truncated download) is refused naming the first tensor that is cut off, and a tensor
  type lightinfer cannot run is refused naming the tensor, its type and the supported ones: both
  before any weight is allocated.
* Config, tokenizer and chat template come from transformers' GGUF support, reading that same parse.
* GGUF -> Hugging Face tensor names come from transformers' own map (``get_gguf_hf_weights_map``,
  built on gguf's ``TensorNameMap``), and so does the processing transformers applies to a tensor
  (Llama's q/k rows, which llama.cpp permutes for its RoPE): lightinfer runs transformers' processor on
  a column of row indices, which yields the same row permutation for the codes, scales and zeros of
  a quantized tensor, so the 4- and 8-bit layouts need no table of their own.
* Raw bytes are read with ``os.pread`` at the offsets the reader found, not through the reader's
  memory map: a mapped page read once stays in the process's resident set until unmapped, so a
  memory-mapped load would add the whole file to the peak RSS.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from lightinfer.formats.gguf_blocks import DENSE_TYPES, UNPACKERS
from lightinfer.formats.gguf_bounds import gguf_config_fields
from lightinfer.formats.gguf_header import read_gguf_header, transformers_reads_header
from lightinfer.formats.gguf_rope import apply_rope_overrides, rope_overrides
from lightinfer.formats.scheme import LINEAR_FORMATS_KEY, LinearFormat

SUPPORTED_TYPES = (*DENSE_TYPES, *UNPACKERS)
# MoE experts stacked in one tensor per projection (llama.cpp's blk.N.ffn_gate_exps: [E, N, K]) are named
# "<experts prefix>.gate_exps" / "up_exps" / "down_exps" here (gguf_load puts them in FusedMoE's stacks).
STACKED_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")
STACKED_SUFFIX = "_exps"
# GGUF metadata (under the architecture's prefix) -> the config field transformers' reader does not fill
_MOE_CONFIG_FIELDS = {"expert_feed_forward_length": "moe_intermediate_size",
                      "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
_SUPPORTED_TEXT = ("F32, F16, BF16 (dense), Q4_0, Q4_1, Q4_K (4-bit kernels), Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 "
                   "(8-bit kernel)")
_SYMMETRIC = {GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, by Hugging Face name.

    Attributes:
        gguf_name: the file's name (``blk.0.attn_q.weight``).
        hf_name: the Hugging Face name (``model.layers.0.self_attn.q_proj.weight``).
        ggml_type: its GGML type.
        shape: Hugging Face orientation: ``(N, K)`` for a matrix (GGUF's ``ne`` reversed), ``(K,)`` for a vector.
        offset: absolute byte offset of its data. nbytes: its data size.
    """

    gguf_name: str
    hf_name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@contextlib.contextmanager
def _cached_gguf_name_map() -> Iterator[None]:
    """transformers' name mapping walks every submodule and builds gguf's ``TensorNameMap`` anew for each
    (~400 times for a 30-layer model, 15 s here); it is a pure function of (arch, layers): memoize it
    while the map is built."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


class GGUFFile:
    """An opened GGUF file (module docstring).

    Args:
        path: the ``.gguf`` file.

    Attributes:
        path, config (transformers config), architecture (GGUF ``general.architecture``),
        tensors (Hugging Face name -> :class:`GGUFTensor`; tensors transformers does not map, such as
        ``rope_freqs``, are left out as transformers leaves them).

    Raises:
        ValueError: a truncated or corrupt file, an unknown or unsupported tensor type (named), an
            architecture transformers cannot map.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = Path(path)
        # Parsed once and checked (counts, lengths, tensor types and extents against the file: gguf_header.py),
        # then the model's sizes validated before transformers or a model class sees them.
        self.header = read_gguf_header(self.path)
        self.architecture = str(self.header.get("general.architecture", "?"))
        infos = [(t.name, t.ggml_type, tuple(reversed(t.dims)), t.offset, t.nbytes) for t in self.header.tensors]
        from lightinfer.models.registry import get_model_class, validate_model_config

        fields, field_names = gguf_config_fields(self.header)
        validate_model_config(fields, str(self.path), field_names)
        rope = rope_overrides(self.header, self.architecture)  # what transformers' reader drops (gguf_rope.py)
        moe_sizes = {key: int(value) for key in _MOE_CONFIG_FIELDS
                     if (value := self.header.get(f"{self.architecture}.{key}")) is not None}
        try:  # trust_remote_code=False: transformers never asks on stdin (lightinfer runs no checkpoint code)
            with transformers_reads_header(self.header):  # not a second (and third) parse of the file
                self.config = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name,
                                                         trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 -- corrupt metadata raises many types (OverflowError, KeyError...)
            raise ValueError(f"{self.path}: transformers cannot read its config from the metadata "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); re-download the file") from None
        apply_rope_overrides(self.config, rope)
        for key, value in moe_sizes.items():  # transformers' GGUF config reader leaves these at their defaults
            if hasattr(self.config, _MOE_CONFIG_FIELDS[key]):
                setattr(self.config, _MOE_CONFIG_FIELDS[key], value)
        validate_model_config(self.config, f"{self.path} (metadata read as a transformers config)")
        self._processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=self.config.to_dict())
        model_cls = get_model_class(self.config)
        # Only for names, built on the meta device (allocates nothing): lightinfer's own model has transformers'
        # parameter names (transformers' modeling module would take ~1 s of start-up to import); a MoE model's
        # stacked experts are named as transformers' fused experts, so those take transformers' model.
        with torch.device("meta"):
            skeleton = (AutoModelForCausalLM.from_config(self.config, trust_remote_code=False)
                        if model_cls.moe_layer_ids(self.config) else model_cls(self.config, None, torch.float32))
        with _cached_gguf_name_map():
            name_map = get_gguf_hf_weights_map(skeleton, self._processor)
        self.tensors: dict[str, GGUFTensor] = {}
        for gguf_name, ggml_type, shape, offset, nbytes in infos:
            hf = name_map.get(gguf_name)
            if (m := STACKED_EXPERTS.fullmatch(gguf_name)) is not None:
                # transformers maps gate and up both to its fused experts.gate_up_proj (a name without ".weight"):
                # keep them apart, stacked
                hf = name_map.get(gguf_name[: -len(".weight")])
                hf = None if hf is None else f"{hf.rsplit('.', 1)[0]}.{m[1]}{STACKED_SUFFIX}"
            if hf is None:
                continue
            if ggml_type not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path}: tensor {gguf_name} ({hf}) is {ggml_type.name}, which lightinfer "
                                 f"cannot run; supported: {_SUPPORTED_TEXT}. Use a file quantized to one of these "
                                 f"(e.g. Q4_K_M) or the original safetensors")
            self.tensors[hf] = GGUFTensor(gguf_name, hf, ggml_type, shape, offset, nbytes)

    # ------------------------------------------------------------------ reading
    def read_raw(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as uint8 ``[rows, row_bytes]`` (rows = N, 1 for a vector)."""
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), t.nbytes, t.offset)
        if len(data) != t.nbytes:
            raise ValueError(f"{self.path}: tensor {t.gguf_name} is truncated ({len(data)} of {t.nbytes} bytes)")
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) >= 2 else 1  # stacked experts: E x N rows
        return np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)

    def dequantize(self, name: str) -> torch.Tensor:
        """One tensor dequantized to fp32 by the ``gguf`` package and processed as transformers does:
        what transformers' GGUF loader would give for ``name``."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        raw = self.read_raw(t)
        if t.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            item = 4 if t.ggml_type == GGMLQuantizationType.F32 else 2
            raw = raw.reshape(-1, t.shape[-1] * item)
        weights = dequantize(raw, t.ggml_type).reshape(t.shape)
        processed = self._processor.process(weights=weights, name=t.gguf_name, tensor_key_mapping={},
                                            parsed_parameters={"tensors": {}}).weights
        return torch.from_numpy(np.array(processed, dtype=np.float32))  # a writable copy

    def row_permutation(self, name: str) -> np.ndarray | None:
        """The row order transformers' processor gives tensor ``name`` (None: unchanged).

        Raises:
            ValueError: the processor changes values, not only row order (the tensor must load dense).
        """
        t = self.tensors[name]
        rows = t.shape[0]
        probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        out = self._processor.process(weights=probe, name=t.gguf_name, tensor_key_mapping={},
                                      parsed_parameters={"tensors": {}}).weights
        out = np.asarray(out)
        if out.shape != probe.shape or not np.array_equal(np.sort(out[:, 0]), probe[:, 0]):
            raise ValueError(f"transformers' processing of {t.gguf_name} is not a row permutation")
        perm = out[:, 0].astype(np.int64)
        return None if np.array_equal(perm, probe[:, 0]) else perm

    # ------------------------------------------------------------------ formats
    def tensor_format(self, name: str) -> LinearFormat:
        """How tensor ``name`` runs: W4 for 4-bit types (groups of 32), W8 for the other quantized ones
        (Q6_K: groups of 16), dense for F32/F16/BF16. A 4-bit matrix whose rows are not a multiple of 8
        (the W4 packing unit) runs as W8 (exact too)."""
        t = self.tensors[name]
        source = f"GGUF {t.type_name}"
        if t.ggml_type in DENSE_TYPES or len(t.shape) not in (2, 3):
            return LinearFormat("dense", 0, False, source)
        kind = UNPACKERS[t.ggml_type][1]
        if kind == "w4" and t.shape[-2] % 8:
            kind = "w8"
        group = 16 if t.ggml_type == GGMLQuantizationType.Q6_K else 32
        return LinearFormat(kind, group, t.ggml_type in _SYMMETRIC, source)

    def quant_config(self) -> dict:
        """The ``quantization_config`` the model is built with: ``quant_method "gguf"`` plus the per-module
        map (:data:`~lightinfer.formats.scheme.LINEAR_FORMATS_KEY`) of every ``*.weight`` matrix."""
        formats = {n[: -len(".weight")]: self.tensor_format(n) for n, t in self.tensors.items()
                   if n.endswith(".weight") and len(t.shape) == 2}
        for n, t in self.tensors.items():  # stacked experts: the format of every expert's projection
            if n.endswith(STACKED_SUFFIX) and len(t.shape) == 3:
                prefix, part = n[: -len(STACKED_SUFFIX)].rsplit(".", 1)
                formats.update({f"{prefix}.{e}.{part}_proj": self.tensor_format(n) for e in range(t.shape[0])})
        w4 = [f for f in formats.values() if f.kind == "w4"]
        return {"quant_method": "gguf", "bits": 4 if w4 else None, "group_size": 32 if w4 else None,
                LINEAR_FORMATS_KEY: formats}

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile:
    """:class:`GGUFFile`, cached: parsing the header and config of a real file takes seconds."""
    return GGUFFile(path)
