"""bench/quality/format_quality.py's own parts, cheaply: the Q4_K encoder, the GGUF re-encoding, the reference
scorer's windows, and the skip of a tool format whose venv is absent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

FORMATS = str(Path(__file__).resolve().parents[1] / "formats")
if FORMATS not in sys.path:  # appended (for gguf_files): shadowing nothing the other tests import
    sys.path.append(FORMATS)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize


def test_q4_k_encoder_round_trips_through_the_gguf_dequantizer() -> None:
    from bench.quality.format_gguf import quantize_q4_k

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero sub-block must not divide by zero
    blocks = quantize_q4_k(w)
    assert blocks.shape == (6, 2 * 144) and blocks.dtype == np.uint8
    back = dequantize(blocks, T.Q4_K)
    step = (w.reshape(6, 2, 8, 32).max(-1) - np.minimum(w.reshape(6, 2, 8, 32).min(-1), 0)) / 15
    # Within one step of the sub-block's range (half a step of rounding plus the 6-bit scale's rounding).
    assert np.all(np.abs(back - w).reshape(6, 2, 8, 32).max(-1) <= step + 1e-6)
    assert np.abs(back[0, :32]).max() == 0.0
    with pytest.raises(ValueError, match="256"):
        quantize_q4_k(w[:, :288])


def test_write_variant_re_encodes_only_q4_1_tensors(tmp_path) -> None:
    from gguf_files import write_tiny_gguf

    from bench.quality.format_gguf import write_variant

    src = write_tiny_gguf(tmp_path / "src.gguf", {k: T.Q4_1 for k in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                       "ffn_gate", "ffn_up", "ffn_down")})
    counts = write_variant(src, tmp_path / "k.gguf", "q4_k")
    # hidden 256: rows of K = 256 take Q4_K; ffn_down (K = 512) too; the embedding (Q8_0) and norms stay.
    assert counts == {"Q8_0": 1, "F32": 5, "Q4_K": 14, "Q6_K": 1}
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(tmp_path / "k.gguf"))
    assert a.fields["llama.block_count"].contents() == b.fields["llama.block_count"].contents()
    ta = {t.name: t for t in a.tensors}
    for t in b.tensors:
        src_w = dequantize(np.asarray(ta[t.name].data), ta[t.name].tensor_type)
        assert np.allclose(dequantize(np.asarray(t.data), t.tensor_type), src_w, atol=0.02), t.name
    assert write_variant(src, tmp_path / "0.gguf", "q4_0")["Q4_0"] == 14


def test_reference_windows_are_the_evaluator_s() -> None:
    from bench.quality.format_ref import windows

    ids = list(range(11))
    assert windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a last window of 1 token scores nothing


@pytest.mark.audit  # runs the benchmark's baseline on the model (~8 s): make test-audit
def test_tool_formats_are_skipped_without_their_venv(tmp_path) -> None:
    from bench.quality import format_quality

    res = format_quality.main(["--only", "gptq-4bit-g64-sym", "ct-lib-channel-asym", "--max-tokens", "16",
                               "--tools-venv", str(tmp_path / "none"), "--work", str(tmp_path / "work"),
                               "--out-dir", str(tmp_path / "out")])
    assert set(res["formats"]) == {"gptq-4bit-g64-sym", "ct-lib-channel-asym"}
    assert all("no tools venv" in r["skipped"] for r in res["formats"].values())
    assert json.loads((tmp_path / "out" / "format_quality.json").read_text())["tokens"] == 16
    assert "skipped" in (tmp_path / "out" / "format_quality.md").read_text()
