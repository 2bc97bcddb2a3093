"""The one walk over a GGUF file's header: every count and length checked as it is read, every value kept.

GGUF's header is a sequence of length-prefixed fields (GGUF v2/v3, little-endian)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: u64 length + UTF-8) | value type u32 | value   (arrays: item type u32, count u64, items)
    tensor_count x  (name: u64 length + UTF-8) | n_dims u32 | n_dims x u64 | ggml type u32 | offset u64

Every count and length is checked against the bytes the file has left before it is used, so a corrupt or
truncated file (a tensor count of 2^62, a 2^60-byte string, a header cut short, an unknown value type)
is refused with one message naming the file, the field and its byte offset, instead of a numpy, struct
or overflow error from deep inside a reader (or a multi-gigabyte allocation). The walk reads through a
memory map, touching only the header's pages.

The same walk yields the values: :func:`walk_gguf_file` is what
:func:`lightinfer.formats.gguf_header.read_gguf_header` builds its header from (checking each tensor's type
and extent on top), so a load reads the header once; :func:`check_gguf_header` returns its metadata alone.
The scalar metadata gives the model's sizes under their GGUF keys, which are checked like a
``config.json``'s (:func:`gguf_config_fields`) before transformers builds anything from them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# value type id -> (struct format, size) of the scalar types; 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
# numeric arrays are read in one numpy call (a 49k-entry token_type array: one call, not 49k unpacks)
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, a type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # an empty name, n_dims 0, a type, an offset
_U64 = struct.Struct("<Q")


@dataclass
class WalkedHeader:
    """What the walk read: ``metadata`` is key -> ``(value type id, value)`` (an array: ``(9, (item type id,
    list))``); ``tensors`` is ``(name, ggml type id, dims in GGUF order, offset from the data section)`` per
    entry, types and extents not yet checked; ``end`` is the byte after the tensor table, ``size`` the file's
    bytes."""

    path: Path
    version: int
    size: int
    metadata: dict[str, tuple[int, Any]]
    tensors: list[tuple[str, int, tuple[int, ...], int]]
    end: int


class _Walker:
    """A cursor over a header's bytes (an mmap or ``bytes``) that refuses to read past them."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {what} (the file has {self.size:,} bytes); "
                          f"it is truncated or corrupt: re-download it")

    def take(self, fmt: str, n: int, what: str) -> Any:
        """The ``n``-byte scalar of struct format ``fmt`` at the cursor; ``what`` names it in the error."""
        if self.pos + n > self.size:
            raise self.fail(f"{what} at byte {self.pos:,} runs past the end of the file")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        """A u64-length-prefixed UTF-8 string at the cursor."""
        start = self.pos
        length = self.take("<Q", 8, f"the length of {what}")
        if length > self.size - self.pos:
            raise self.fail(f"{what} at byte {start:,} claims {length:,} bytes, more than the file has left")
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start:,} is not UTF-8 text") from None

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings at the cursor: :meth:`string`'s checks and messages, without building a message
        per item (a tokenizer's ~100,000 tokens and merges would spend as long on them as on the reading)."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"the length of item {i} of {what} at byte {pos:,} runs past the end of the file")
            (length,) = _U64.unpack_from(buf, pos)
            if length > size - pos - 8:
                raise self.fail(f"item {i} of {what} at byte {pos:,} claims {length:,} bytes, more than the file "
                                f"has left")
            try:
                out.append(str(buf[pos + 8:pos + 8 + length], "utf-8"))
            except UnicodeDecodeError:
                raise self.fail(f"item {i} of {what} at byte {pos:,} is not UTF-8 text") from None
            pos += 8 + length
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        """A value of GGUF value type ``vtype`` at the cursor: a scalar, a str, or ``(item type id, list)``."""
        if vtype in _SCALARS:
            fmt, n = _SCALARS[vtype]
            return self.take(fmt, n, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            item_type = self.take("<I", 4, f"the item type of {what}")
            count = self.take("<Q", 8, f"the length of {what}")
            if item_type == _ARRAY or (item_type not in _SCALARS and item_type != _STRING):
                raise self.fail(f"{what} has items of unknown type {item_type}")
            item_size = 8 if item_type == _STRING else _SCALARS[item_type][1]
            if count > (self.size - self.pos) // item_size:
                raise self.fail(f"{what} claims {count:,} items, more than the file has bytes for")
            if item_type == _STRING:
                return item_type, self.strings(count, what)
            items = np.frombuffer(self.buf, dtype=_NUMPY[item_type], count=count, offset=self.pos).tolist()
            self.pos += count * item_size
            return item_type, items
        raise self.fail(f"{what} at byte {self.pos - 4:,} has unknown value type {vtype}")


def walk_gguf_file(path: str | Path) -> WalkedHeader:
    """Walk the header of the GGUF file ``path`` once, checking every count and length against the file and
    reading every value (module docstring).

    Raises:
        ValueError: naming the file, the field and its offset: not a GGUF file, an unsupported version, a
            big-endian file, a count or length beyond the file, an unknown value type, text that is not UTF-8,
            a tensor with more than 4 dimensions or an overflowing element count.
    """
    p = Path(path)
    with open(p, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{p} is not a GGUF file: {size} bytes, shorter than a GGUF header (24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(_Walker(buf, p))


def check_gguf_header(path: str | Path) -> dict[str, Any]:
    """Check the header of the GGUF file ``path`` (:func:`walk_gguf_file`, the same single walk a load makes).

    Returns:
        ``{key: value}`` of the metadata: scalars and strings as they are, arrays as lists.
    Raises:
        ValueError: as :func:`walk_gguf_file`.
    """
    return {key: value[1] if kind == _ARRAY else value
            for key, (kind, value) in walk_gguf_file(path).metadata.items()}


def _walk(w: _Walker) -> WalkedHeader:
    if bytes(w.buf[:4]) != b"GGUF":
        raise ValueError(f"{w.path} is not a GGUF file (it does not start with 'GGUF'); give a .gguf model file")
    w.pos = 4
    version = w.take("<I", 4, "the version")
    if version not in (2, 3):
        if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise ValueError(f"{w.path} is a big-endian GGUF file; lightinfer reads little-endian files only")
        raise ValueError(f"{w.path}: GGUF version {version} is not supported (2 and 3 are); re-convert the model "
                         f"with a current llama.cpp")
    num_tensors = w.take("<Q", 8, "the tensor count")
    num_kv = w.take("<Q", 8, "the metadata count")
    if num_kv > (w.size - w.pos) // _MIN_KV_BYTES:
        raise w.fail(f"the header claims {num_kv:,} metadata entries, more than the file has bytes for")
    if num_tensors > (w.size - w.pos) // _MIN_TENSOR_BYTES:
        raise w.fail(f"the header claims {num_tensors:,} tensors, more than the file has bytes for")
    metadata: dict[str, tuple[int, Any]] = {}
    for i in range(num_kv):
        key = w.string(f"the key of metadata entry {i}")
        vtype = w.take("<I", 4, f"the value type of {key!r}")
        metadata[key] = (vtype, w.value(vtype, f"metadata {key!r}"))
    tensors = []
    for i in range(num_tensors):
        name = w.string(f"the name of tensor {i}")
        n_dims = w.take("<I", 4, f"the dimension count of tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise w.fail(f"tensor {name!r} claims {n_dims:,} dimensions (GGUF has at most {_MAX_DIMS})")
        dims = tuple(w.take("<Q", 8, f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        numel = 1
        for d in dims:
            numel *= d
        if numel >= 1 << 48:  # 256 T elements: nothing real; the byte arithmetic after this stays in int64
            raise w.fail(f"tensor {name!r} claims {numel:,} elements")
        type_id = w.take("<I", 4, f"the type of tensor {name!r}")
        offset = w.take("<Q", 8, f"the data offset of tensor {name!r}")
        tensors.append((name, type_id, dims, offset))
    return WalkedHeader(w.path, version, w.size, metadata, tensors, w.pos)


# transformers config field -> GGUF metadata key (after "{architecture}.")
_FIELDS = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
           "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
           "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
           "head_dim": "attention.key_length"}


def gguf_config_fields(metadata: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The model sizes of a GGUF's metadata under transformers' names, and each field's GGUF key (for
    messages): ``({"model_type": "llama", "hidden_size": 576, ...}, {"hidden_size": "llama.embedding_length"})``.

    Args:
        metadata: anything with ``.get(key)`` giving arrays as lists: :func:`check_gguf_header`'s dict, or a
            parsed header (``gguf_header.GGUFHeader``).
    Fields the file does not have are left out; ``vocab_size`` is the length of ``tokenizer.ggml.tokens``.
    """
    arch = metadata.get("general.architecture")
    config: dict[str, Any] = {"model_type": arch} if isinstance(arch, str) else {}
    names: dict[str, str] = {}
    for field, key in _FIELDS.items():
        full = f"{arch}.{key}"
        value = metadata.get(full)
        if value is not None:
            config[field] = f"an array of {len(value)} items" if isinstance(value, (list, tuple)) else value
            names[field] = full
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, (list, tuple)):
        config["vocab_size"] = len(tokens)
        names["vocab_size"] = "the length of tokenizer.ggml.tokens"
    return config, names
