"""Tensor headers of a safetensors checkpoint without reading any tensor data: names, dtypes, shapes and byte
sizes from each file's JSON header (the 8-byte little-endian length, then the header). What ``lightinfer fit``
needs to size a checkpoint in well under a second, even a 70B one; a file whose data region is cut short still
has a readable header (the loader, not this module, refuses truncated files)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# A safetensors header is at most 100 MB (the format's own limit); more means a corrupt length field.
MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as its file's header describes it.

    Attributes:
        name: Hugging Face name. dtype: safetensors dtype string ("BF16", "I32"...).
        shape: dimensions. nbytes: bytes of its data in the file. file: the shard holding it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: Path


def read_safetensors_header(path: Path) -> dict[str, TensorHeader]:
    """The tensors of one ``.safetensors`` file, from its header only.

    Raises:
        ValueError: the file is too short for its header, or the header is not the safetensors JSON (named).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        size = int.from_bytes(head, "little")
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file (header length {size} bytes is implausible)")
        raw = f.read(size)
    try:
        header = json.loads(raw)
        out = {}
        for name, v in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in v["data_offsets"])
            out[name] = TensorHeader(name, str(v["dtype"]), tuple(int(d) for d in v["shape"]), end - begin, path)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} has no readable safetensors header ({e}); re-download or re-export it") from None
    return out


def safetensors_headers(folder: Path) -> dict[str, TensorHeader]:
    """Every tensor of a Hugging Face folder's safetensors weights (sharded through
    ``model.safetensors.index.json`` or not), from the headers only; empty when the folder has none
    (a bare ``config.json``).

    Raises:
        FileNotFoundError: the index names a shard that is missing.
        ValueError: a header that cannot be read (see :func:`read_safetensors_header`).
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a readable safetensors index ({e})") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    out: dict[str, TensorHeader] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{index} names the shard {name}, which is missing")
        out.update(read_safetensors_header(path))
    return out
