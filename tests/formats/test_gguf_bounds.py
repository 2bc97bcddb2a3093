"""Corrupt and truncated GGUF files fail in one ``error:`` line naming the file and the field (issue 19 item 7):
huge counts, a 2^60-byte string, a header cut short, an unknown value type, metadata sizes that are no
model's. The header walk runs before any other reader, so none of them allocates or takes long."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from lightinfer.cli import main
from lightinfer.formats.gguf_bounds import check_gguf_header, gguf_config_fields
from tests.formats.gguf_files import write_tiny_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf").read_bytes()


def _first_value_offset(data: bytes) -> int:
    key_len = struct.unpack_from("<Q", data, 24)[0]
    return 32 + key_len  # the first entry's value type, then its value


def _set_scalar(data: bytes, key: str, fmt: str, value: int) -> bytes:
    """``data`` with the scalar metadata ``key`` (of struct format ``fmt``) set to ``value``."""
    needle = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(needle) + len(needle) + 4  # past the key and its value type
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


CORRUPTIONS = {
    "tensor count 2^62": (lambda d: d[:8] + struct.pack("<Q", 2**62) + d[16:],
                          "the header claims 4,611,686,018,427,387,904 tensors"),
    "metadata count 2^62": (lambda d: d[:16] + struct.pack("<Q", 2**62) + d[24:],
                            "the header claims 4,611,686,018,427,387,904 metadata entries"),
    "key of 2^60 bytes": (lambda d: d[:24] + struct.pack("<Q", 2**60) + d[32:],
                          "the key of metadata entry 0 at byte 24 claims 1,152,921,504,606,846,976 bytes"),
    "string value of 2^60 bytes": (
        lambda d: d[:_first_value_offset(d) + 4] + struct.pack("<Q", 2**60) + d[_first_value_offset(d) + 12:],
        "metadata 'general.architecture' at byte 56 claims 1,152,921,504,606,846,976 bytes"),
    "unknown value type": (
        lambda d: d[:_first_value_offset(d)] + struct.pack("<I", 2**31 + 5) + d[_first_value_offset(d) + 4:],
        "has unknown value type 2147483653"),
    "cut in the metadata": (lambda d: d[:2000], "claims 272 items, more than the file has bytes for"),
    "cut in the tensor table": (lambda d: d[:_tensor_table_start(d) + 30], "runs past the end of the file"),
    "cut after 30 bytes": (lambda d: d[:30], "the header claims 17 metadata entries"),
    "shorter than a header": (lambda d: d[:20], "shorter than a GGUF header"),
    "not GGUF": (lambda d: b"GGUX" + d[4:], "does not start with 'GGUF'"),
    "version 1": (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "GGUF version 1 is not supported"),
    "block_count a million": (lambda d: _set_scalar(d, "llama.block_count", "<I", 1_000_000),
                              "llama.block_count is 1,000,000, beyond any real model"),
    "head_count 0": (lambda d: _set_scalar(d, "llama.attention.head_count", "<I", 0),
                     "llama.attention.head_count is 0; it must be a positive integer"),
    "head_count_kv 3": (lambda d: _set_scalar(d, "llama.attention.head_count_kv", "<I", 3),
                        "llama.attention.head_count_kv=3 does not divide llama.attention.head_count=4"),
    "embedding_length 2^31": (lambda d: _set_scalar(d, "llama.embedding_length", "<I", 2**31),
                              "llama.embedding_length is 2,147,483,648, beyond any real model"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_file_is_one_clear_line(tmp_path: Path, capsys, good: bytes, case: str) -> None:
    corrupt, message = CORRUPTIONS[case]
    path = tmp_path / "model.gguf"
    path.write_bytes(corrupt(good))
    t = time.perf_counter()
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    # the load's progress lines ("lightinfer: [  0.0 s] reading ...") aside, one error line
    err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True)
                  if not line.startswith("lightinfer: ["))
    assert time.perf_counter() - t < 10
    assert err.startswith(f"error: {path}") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_tensor_table_corruption(tmp_path: Path, good: bytes) -> None:
    """A tensor with 2^40 x 2^40 elements or 9 dimensions is refused by the walk (the stock reader would try
    to build a view of it)."""
    meta_end = _tensor_table_start(good)
    name_len = struct.unpack_from("<Q", good, meta_end)[0]
    dims_at = meta_end + 8 + name_len
    path = tmp_path / "m.gguf"
    path.write_bytes(good[:dims_at] + struct.pack("<I", 9) + good[dims_at + 4:])
    with pytest.raises(ValueError, match="claims 9 dimensions"):
        check_gguf_header(path)
    n_dims = struct.unpack_from("<I", good, dims_at)[0]
    huge = b"".join(struct.pack("<Q", 2**40) for _ in range(n_dims))
    path.write_bytes(good[:dims_at + 4] + huge + good[dims_at + 4 + 8 * n_dims:])
    with pytest.raises(ValueError, match="elements"):
        check_gguf_header(path)


def _tensor_table_start(data: bytes) -> int:
    """Offset of the first tensor info, by walking the metadata with the module's own walker."""
    from lightinfer.formats import gguf_bounds as H

    w = H._Walker(data, Path("x"))
    w.pos = 16
    num_kv = w.take("<Q", 8, "n")
    for _ in range(num_kv):
        key = w.string("k")
        w.value(w.take("<I", 4, "t"), key)
    return w.pos


def test_good_file_metadata_in_transformers_names(tmp_path: Path, good: bytes) -> None:
    path = tmp_path / "good.gguf"
    path.write_bytes(good)
    config, names = gguf_config_fields(check_gguf_header(path))
    assert config["model_type"] == "llama" and config["num_attention_heads"] == 4 and config["vocab_size"] == 272
    assert names["num_hidden_layers"] == "llama.block_count"
