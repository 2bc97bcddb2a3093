"""A GGUF file's header (metadata and tensor table) read in one pass, fast.

The ``gguf`` package's ``GGUFReader`` makes a numpy view of every part of every field: a tokenizer of
49,152 tokens and 48,900 merges is ~440,000 views, 2-3 s of CPU per read, and a load read the header
three times (the tensor table here, then transformers' GGUF config reader twice, for the config and for
the tokenizer's config): ~8 s of a 135M model's start-up. :func:`read_gguf_header` reads it in one
bounds-checked walk with ``struct`` over a memory map (``gguf_bounds.walk_gguf_file``: magic, version, byte
order, every count and length checked as it is read; ~0.06 s for a 49k-token vocabulary), checks every
tensor's type and extent against the file size, and :func:`transformers_reads_header` lets transformers'
config and tokenizer readers use that parse instead of reading the file again.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from lightinfer.formats.gguf_bounds import WalkedHeader, walk_gguf_file

_STRING, _ARRAY = 8, 9  # GGUF's value type ids of a string and an array


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-table entry: ``dims`` in GGUF order (fastest-moving first), ``offset`` absolute in the file."""

    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """A parsed header. ``metadata``: key -> ``(value type id, value)`` (arrays: ``(9, (item type, list))``)."""

    path: Path
    version: int
    metadata: dict[str, tuple[int, Any]]
    tensors: list[TensorInfo]
    transformers_parse: dict | None = None  # transformers' config reader's result (transformers_reads_header)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (an array as a list), or ``default``."""
        entry = self.metadata.get(key)
        if entry is None:
            return default
        return entry[1][1] if entry[0] == _ARRAY else entry[1]


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and check ``path``'s header (module docstring) in one walk (``gguf_bounds.walk_gguf_file``: counts,
    lengths and value types checked as they are read), then check each tensor's type and extent.

    Raises:
        ValueError: not a GGUF file, an unsupported version, a big-endian file, a corrupt or truncated
            header (the field and its byte offset named), a tensor of an unknown type or extending past the
            end of the file (named).
    """
    walked = walk_gguf_file(path)
    return GGUFHeader(walked.path, walked.version, walked.metadata, _tensor_table(walked))


def _tensor_table(walked: WalkedHeader) -> list[TensorInfo]:
    """The walked tensor entries with their types known and their data inside the file (absolute offsets)."""
    path, size = walked.path, walked.size
    alignment = walked.metadata.get("general.alignment", (4, 32))[1]
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path} is not a readable GGUF file: general.alignment {alignment!r} is not a power of "
                         f"two; it is corrupt: re-download it")
    data_start = (walked.end + alignment - 1) // alignment * alignment
    tensors = []
    for name, type_id, dims, offset in walked.tensors:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has GGML type id {type_id}, which this gguf package does not "
                             f"know") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n = math.prod(dims)  # < 2^48 (the walk refuses more), so the byte count below is exact
        nbytes = n * type_size // block
        start = data_start + offset
        if start + nbytes > size:
            raise ValueError(f"{path}: is truncated: tensor {name} ({ggml_type.name}, {n} elements) ends at byte "
                             f"{start + nbytes} but the file has {size} bytes; re-download it")
        tensors.append(TensorInfo(name, ggml_type, dims, start, nbytes))
    return tensors


# ------------------------------------------------------------------ transformers' readers on this parse
class _Field:
    """What transformers reads of a ``gguf.ReaderField``: ``parts[i]`` for ``i in data``, and ``types``."""

    def __init__(self, name: str, kind: int, value: Any) -> None:
        self.name = name
        if kind == _ARRAY:
            item, items = value
            self.types = [_ARRAY, item]
            self.parts = [v.encode() if item == _STRING else (v,) for v in items]
        else:
            self.types = [kind]
            self.parts = [value.encode() if kind == _STRING else (value,)]
        self.data = range(len(self.parts))

    def contents(self) -> Any:
        values = [p.decode() if isinstance(p, bytes) else p[0] for p in self.parts]
        return values if self.types[0] == _ARRAY else values[0]


# Arrays only transformers' tokenizer builder reads (through its own reader): its config reader would parse
# ~100,000 values of them for nothing. The token list stays (a config without vocab_size counts it).
_TOKENIZER_ONLY = ("tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


class _HeaderReader:
    """A stand-in for ``gguf.GGUFReader`` over a parsed header, for transformers' config reader: metadata
    (less :data:`_TOKENIZER_ONLY`) and tensor names."""

    def __init__(self, header: GGUFHeader) -> None:
        self.fields = {k: _Field(k, kind, v) for k, (kind, v) in header.metadata.items() if k not in _TOKENIZER_ONLY}
        self.tensors = header.tensors  # .name is all transformers reads when no tensors are asked for


@contextlib.contextmanager
def transformers_reads_header(header: GGUFHeader) -> Iterator[None]:
    """Inside the block, transformers' GGUF config reader (``load_gguf_checkpoint`` without tensors, which
    ``AutoConfig`` and ``AutoTokenizer`` both call for a ``gguf_file``) reads ``header`` instead of parsing
    the file again with ``gguf.GGUFReader``, and its result is kept on ``header`` for the next call; any
    other file, or a call that wants tensors, goes to the real reader. Not thread-safe."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original_reader, original_load = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint
    target = os.path.realpath(header.path)

    def open_reader(path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.realpath(path) == target:
            return _HeaderReader(header)
        return original_reader(path, *args, **kwargs)

    def load(path: str | os.PathLike, return_tensors: bool = False, *args: Any, **kwargs: Any) -> dict:
        if return_tensors or args or kwargs or os.path.realpath(path) != target:
            return original_load(path, return_tensors, *args, **kwargs)
        if header.transformers_parse is None:
            header.transformers_parse = original_load(path, return_tensors=False)
        return {k: dict(v) if isinstance(v, dict) else v for k, v in header.transformers_parse.items()}

    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = open_reader, load
    try:
        yield
    finally:
        gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = original_reader, original_load
