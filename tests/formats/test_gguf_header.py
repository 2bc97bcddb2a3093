"""The one-pass GGUF header parse (lightinfer/formats/gguf_header.py): the same tensor table as the ``gguf``
package's reader, the same config and tokenizer through transformers, bad files refused with the file named."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from gguf import GGUFReader

from lightinfer.formats.gguf_header import read_gguf_header, transformers_reads_header
from tests.formats.gguf_files import write_tiny_gguf


def test_tensor_table_and_metadata_equal_gguf_readers(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    header = read_gguf_header(path)
    reader = GGUFReader(path)
    assert [(t.name, t.ggml_type, t.offset, t.nbytes) for t in header.tensors] == [
        (t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    assert [tuple(reversed(t.dims)) for t in header.tensors] == [
        tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors]
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]  # the reader's own version/count entries
    assert keys == list(header.metadata)
    for key in keys:
        want = reader.fields[key].contents()
        assert header.get(key) == pytest.approx(want), key


def test_transformers_reads_the_parse_not_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = write_tiny_gguf(tmp_path / "m.gguf")
    want_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    want_ids = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)("hello world")["input_ids"]
    header = read_gguf_header(path)
    opened = []
    import gguf

    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: opened.append(a) or real(*a, **k))
    with transformers_reads_header(header):
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert not opened  # the file was not parsed again by gguf's reader
    assert config.to_dict() == want_config
    assert tokenizer("hello world")["input_ids"] == want_ids
    assert header.transformers_parse is not None  # the config reader ran once, its result kept


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_bad_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "m.gguf").read_bytes()
    cases = {
        "magic.gguf": (b"GGUX" + data[4:], "not a GGUF file"),
        "version.gguf": (_patched(data, 4, "<I", 7), "version 7"),
        "bigendian.gguf": (_patched(data, 4, ">I", 3), "big-endian"),
        "header.gguf": (data[:200], "not a readable GGUF file"),
        "count.gguf": (_patched(data, 16, "<Q", 2**60), "not a readable GGUF file"),
        "cut.gguf": (data[:-1000], r"truncated: tensor \S+ "),
        "tiny.gguf": (data[:10], "not a GGUF file"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message) as e:
            read_gguf_header(bad)
        assert name in str(e.value), name


def test_header_is_mapped_and_walked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass both checks the header and yields its values: the file is memory-mapped once per read (the
    bounds check and the parse used to map and walk it twice)."""
    import mmap

    path = write_tiny_gguf(tmp_path / "m.gguf")
    maps = []
    real = mmap.mmap
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: maps.append(a) or real(*a, **k))
    header = read_gguf_header(path)
    assert len(maps) == 1
    assert len(header.get("tokenizer.ggml.tokens")) == 272 and header.tensors


def test_bad_token_strings_are_named_with_their_offset(tmp_path: Path) -> None:
    """The string-array fast path keeps the walk's per-item checks and messages."""
    data = write_tiny_gguf(tmp_path / "m.gguf").read_bytes()
    key = b"tokenizer.ggml.tokens"
    item0 = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4 + 8  # type, item type, count
    length = struct.unpack_from("<Q", data, item0)[0]
    cases = {
        "long.gguf": (_patched(data, item0, "<Q", 2**60),
                      f"item 0 of metadata 'tokenizer.ggml.tokens' at byte {item0:,} claims {2**60:,} bytes"),
        "utf8.gguf": (data[:item0 + 8] + b"\xff" * length + data[item0 + 8 + length:],
                      f"item 0 of metadata 'tokenizer.ggml.tokens' at byte {item0:,} is not UTF-8 text"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ValueError) as e:
            read_gguf_header(bad)
        assert str(e.value).startswith(f"{bad} is not a readable GGUF file: {message}"), str(e.value)
