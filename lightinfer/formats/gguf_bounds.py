"""A bounds-checked walk over a GGUF file's header, before any other reader sees the file.

GGUF's header is a sequence of length-prefixed fields (GGUF v2/v3, little-endian)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: u64 length + UTF-8) | value type u32 | value   (arrays: item type u32, count u64, items)
    tensor_count x  (name: u64 length + UTF-8) | n_dims u32 | n_dims x u64 | ggml type u32 | offset u64

Every count and length is checked against the bytes the file has left before it is used, so a corrupt or
truncated file (a tensor count of 2^62, a 2^60-byte string, a header cut short, an unknown value type)
is refused with one message naming the file, the field and its byte offset, instead of a numpy, struct
or overflow error from deep inside a reader (or a multi-gigabyte allocation). The walk reads through a
memory map, touching only the header's pages.

The scalar metadata it returns gives the model's sizes under their GGUF keys, which are checked like a
``config.json``'s (:func:`gguf_config_fields`) before transformers builds anything from them.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

# value type id -> (struct format, size) of the scalar types; 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, a type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # an empty name, n_dims 0, a type, an offset


class _Walker:
    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {what} (the file has {self.size:,} bytes); "
                          f"it is truncated or corrupt: re-download it")

    def take(self, fmt: str, n: int, what: str) -> Any:
        if self.pos + n > self.size:
            raise self.fail(f"{what} at byte {self.pos:,} runs past the end of the file")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        start = self.pos
        length = self.take("<Q", 8, f"the length of {what}")
        if length > self.size - self.pos:
            raise self.fail(f"{what} at byte {start:,} claims {length:,} bytes, more than the file has left")
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start:,} is not UTF-8 text") from None

    def value(self, vtype: int, what: str) -> Any:
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
                for i in range(count):
                    self.string(f"item {i} of {what}")
            else:
                self.pos += count * item_size
            return _ArrayLength(count)
        raise self.fail(f"{what} at byte {self.pos - 4:,} has unknown value type {vtype}")


class _ArrayLength(int):
    """An array's item count, standing for the array in the returned metadata."""


def check_gguf_header(path: str | Path) -> dict[str, Any]:
    """Walk the header of the GGUF file ``path``, checking every count and length against the file.

    Returns:
        ``{key: value}`` of the metadata: scalars and strings as they are, arrays as their item count.
    Raises:
        ValueError: naming the file, the field and its offset: not a GGUF file, an unsupported version, a
            big-endian file, a count or length beyond the file, an unknown value type, a tensor with more
            than 4 dimensions or an overflowing element count.
    """
    p = Path(path)
    with open(p, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{p} is not a GGUF file: {size} bytes, shorter than a GGUF header (24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(_Walker(buf, p))


def _walk(w: _Walker) -> dict[str, Any]:
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
    metadata: dict[str, Any] = {}
    for i in range(num_kv):
        key = w.string(f"the key of metadata entry {i}")
        vtype = w.take("<I", 4, f"the value type of {key!r}")
        metadata[key] = w.value(vtype, f"metadata {key!r}")
    for i in range(num_tensors):
        name = w.string(f"the name of tensor {i}")
        n_dims = w.take("<I", 4, f"the dimension count of tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise w.fail(f"tensor {name!r} claims {n_dims:,} dimensions (GGUF has at most {_MAX_DIMS})")
        numel = 1
        for d in range(n_dims):
            numel *= w.take("<Q", 8, f"dimension {d} of tensor {name!r}")
        if numel >= 1 << 48:  # 256 T elements: nothing real; the byte arithmetic after this stays in int64
            raise w.fail(f"tensor {name!r} claims {numel:,} elements")
        w.take("<I", 4, f"the type of tensor {name!r}")
        w.take("<Q", 8, f"the data offset of tensor {name!r}")
    return metadata


# transformers config field -> GGUF metadata key (after "{architecture}.")
_FIELDS = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
           "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
           "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
           "head_dim": "attention.key_length"}


def _array_length(value: Any) -> int | None:
    """The item count of an array value (this walk's :class:`_ArrayLength`, or a parsed list), else None."""
    if isinstance(value, _ArrayLength):
        return int(value)
    return len(value) if isinstance(value, (list, tuple)) else None


def gguf_config_fields(metadata: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The model sizes of a GGUF's metadata under transformers' names, and each field's GGUF key (for
    messages): ``({"model_type": "llama", "hidden_size": 576, ...}, {"hidden_size": "llama.embedding_length"})``.

    Args:
        metadata: anything with ``.get(key)``: :func:`check_gguf_header`'s dict (arrays as their length), or a
            parsed header whose arrays are lists.
    Fields the file does not have are left out; ``vocab_size`` is the length of ``tokenizer.ggml.tokens``.
    """
    arch = metadata.get("general.architecture")
    config: dict[str, Any] = {"model_type": arch} if isinstance(arch, str) else {}
    names: dict[str, str] = {}
    for field, key in _FIELDS.items():
        full = f"{arch}.{key}"
        value = metadata.get(full)
        if value is not None:
            length = _array_length(value)
            config[field] = value if length is None else f"an array of {length} items"
            names[field] = full
    tokens = _array_length(metadata.get("tokenizer.ggml.tokens"))
    if tokens is not None:
        config["vocab_size"] = tokens
        names["vocab_size"] = "the length of tokenizer.ggml.tokens"
    return config, names
