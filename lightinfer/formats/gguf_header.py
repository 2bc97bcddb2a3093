"""A GGUF file's header (metadata and tensor table) read in one pass, fast.

The ``gguf`` package's ``GGUFReader`` makes a numpy view of every part of every field: a tokenizer of
49,152 tokens and 48,900 merges is ~440,000 views, 2-3 s of CPU per read, and a load read the header
three times (the tensor table here, then transformers' GGUF config reader twice, for the config and for
the tokenizer's config): ~8 s of a 135M model's start-up. :func:`read_gguf_header` parses it with
``struct`` over a memory map (~0.2 s), checks it (magic, version, byte order, every tensor's type and
extent against the file size), and :func:`transformers_reads_header` lets transformers' config and
tokenizer readers use that parse instead of reading the file again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# scalar value types: struct format and size (GGUF's GGUFValueType ids)
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_MAX_ITEMS = 1 << 32  # a count beyond this is a corrupt header, not a real file


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


class _Reader:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, kind: int) -> Any:
        fmt, size = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def count(self) -> int:
        n = self.scalar(10)
        if n > _MAX_ITEMS or self.pos + n > len(self.buf):
            raise ValueError(f"a length of {n} at byte {self.pos - 8} runs past the end of the file")
        return n

    def string(self) -> str:
        n = self.count()
        self.pos += n
        return self.buf[self.pos - n: self.pos].decode("utf-8", "replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item = self.scalar(4)
            n = self.count()
            if item == _STRING:
                return item, [self.string() for _ in range(n)]
            if item not in _NUMPY:
                raise ValueError(f"an array of value type {item} (not a GGUF type)")
            arr = np.frombuffer(self.buf, dtype=_NUMPY[item], count=n, offset=self.pos).copy()
            self.pos += arr.nbytes
            return item, arr.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"value type {kind} (not a GGUF type) at byte {self.pos - 4}")
        return self.scalar(kind)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and check ``path``'s header (module docstring).

    Raises:
        ValueError: not a GGUF file, an unsupported version, a big-endian file, a corrupt or truncated
            header, a tensor of an unknown type or extending past the end of the file (named).
    """
    from lightinfer.formats.gguf_bounds import check_gguf_header

    path = Path(path)
    # Every count and length checked against the file first, each refusal naming the field and its offset
    # (~0.06 s for a 49k-token vocabulary); the parse below then builds the values.
    check_gguf_header(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"{path} is not a GGUF file (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
            (version,) = struct.unpack_from("<I", buf, 4)
            if version & 0xFFFF == 0 and version:
                raise ValueError(f"{path} is a big-endian GGUF file; lightinfer reads little-endian files only")
            if version not in _VERSIONS:
                raise ValueError(f"{path} is GGUF version {version}; lightinfer reads versions 2 and 3")
            try:
                return _parse(_Reader(buf, path), version, size)
            except _TensorError as e:
                raise ValueError(f"{path}: {e}") from None
            except (struct.error, UnicodeDecodeError, OverflowError, ValueError, KeyError) as e:
                raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt header: {e}); "
                                 f"re-download it") from None


class _TensorError(ValueError):
    """A per-tensor problem (reported with the file name in front)."""


def _parse(r: _Reader, version: int, size: int) -> GGUFHeader:
    r.pos = 8
    tensor_count, kv_count = r.scalar(10), r.scalar(10)
    if tensor_count > _MAX_ITEMS or kv_count > _MAX_ITEMS:
        raise ValueError(f"{tensor_count} tensors / {kv_count} metadata entries")
    metadata: dict[str, tuple[int, Any]] = {}
    for _ in range(kv_count):
        key = r.string()
        kind = r.scalar(4)
        metadata[key] = (kind, r.value(kind))
    entries = []
    for _ in range(tensor_count):
        name = r.string()
        ndims = r.scalar(4)
        if ndims > 8:
            raise ValueError(f"tensor {name} has {ndims} dimensions")
        dims = tuple(r.scalar(10) for _ in range(ndims))
        type_id, offset = r.scalar(4), r.scalar(10)
        entries.append((name, type_id, dims, offset))
    alignment = metadata.get("general.alignment", (4, 32))[1]
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = (r.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, type_id, dims, offset in entries:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise _TensorError(f"tensor {name} has GGML type id {type_id}, which this gguf package does not "
                               f"know") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n = int(np.prod(dims, dtype=np.int64)) if dims else 1
        nbytes = n * type_size // block
        start = data_start + offset
        if start + nbytes > size:
            raise _TensorError(f"is truncated: tensor {name} ({ggml_type.name}, {n} elements) ends at byte "
                               f"{start + nbytes} but the file has {size} bytes; re-download it")
        tensors.append(TensorInfo(name, ggml_type, dims, start, nbytes))
    return GGUFHeader(r.path, version, metadata, tensors)


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
