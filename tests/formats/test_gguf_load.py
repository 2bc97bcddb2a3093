"""GGUF files load tensor by tensor into the W4 / W8 / dense layouts, equal to transformers' own GGUF
reading (the oracle: ``gguf`` dequantization + transformers' q/k un-permutation), and bad files fail
clearly before the model is built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from lightinfer import LLM
from lightinfer.formats.gguf_file import open_gguf
from lightinfer.formats.gguf_load import load_gguf_weights
from lightinfer.layers.linear import Linear, W4A16Linear
from lightinfer.layers.quant_embed import QuantizedLMHead, QuantizedVocabEmbedding, dequantize_rows
from lightinfer.layers.w8_linear import W8A16Linear
from lightinfer.loader import Checkpoint, _read_gguf, load_weights
from lightinfer.models.registry import get_model_class
from tests.formats.gguf_files import write_tiny_gguf

ALL_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q4_1, "ffn_gate": T.Q5_K,
             "ffn_up": T.Q8_0, "ffn_down": T.Q5_1, "token_embd": T.Q4_0, "output": T.F16}


def _model(path: Path, dtype: torch.dtype = torch.float32, **kw: object):  # type: ignore[no-untyped-def]
    ck = Checkpoint(path)
    model = get_model_class(ck.hf_config)(ck.hf_config, ck.quant_config, dtype)
    if kw:
        report = load_gguf_weights(model, ck.gguf, **kw)
    else:
        report = load_weights(model, ck)
    return model, report


def _dense(module: torch.nn.Module) -> torch.Tensor:
    if isinstance(module, (W4A16Linear, W8A16Linear)):
        return module.dense_weight().float()
    if isinstance(module, (QuantizedVocabEmbedding, QuantizedLMHead)):
        t = module.table
        return dequantize_rows(t, torch.arange(t.out_features)).float()
    return module.weight.float()


@pytest.mark.parametrize("tied", [False, True])
def test_weights_equal_transformers_gguf_reading(tmp_path: Path, tied: bool) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", ALL_TYPES, tied=tied)
    _, oracle = _read_gguf(str(path))
    model, report = _model(path)
    modules = dict(model.named_modules())
    for name, want in oracle.items():
        module = modules[name.rsplit(".", 1)[0]]
        got = _dense(module) if name.endswith("proj.weight") or "embed" in name or "lm_head" in name else \
            dict(model.named_parameters())[name].float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    kinds = {n.rsplit(".", 1)[-1]: type(m) for n, m in model.named_modules()}
    assert kinds["q_proj"] is W4A16Linear and kinds["k_proj"] is W4A16Linear and kinds["o_proj"] is W4A16Linear
    assert kinds["v_proj"] is W8A16Linear and kinds["gate_proj"] is W8A16Linear and kinds["down_proj"] is W8A16Linear
    assert isinstance(model.model.embed_tokens, QuantizedVocabEmbedding)
    assert report["model.layers.0.self_attn.q_proj"] == "W4 (GGUF Q4_K, g32)"
    assert report["model.layers.0.self_attn.v_proj"] == "W8 (GGUF Q6_K, g16)"
    if tied:
        assert model.lm_head.table is model.model.embed_tokens.table
    else:
        assert type(model.lm_head).__name__ == "LMHead" and report["lm_head"] == "dense (GGUF F16)"


def test_fp16_layout_is_within_fp16_rounding(tmp_path: Path) -> None:
    """In fp16 the scale (Q4_K: d * sc) and the fractional zero round to fp16: the error stays below
    fp16 rounding of |q - z| <= 16 steps of the group's scale, plus that of the weight itself."""
    path = write_tiny_gguf(tmp_path / "m.gguf", ALL_TYPES)
    _, oracle = _read_gguf(str(path))
    model, _ = _model(path, torch.float16)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        module = dict(model.named_modules())[name[: -len(".weight")]]
        assert module.scales.dtype == torch.float16 and module.zeros.dtype == torch.float16
        want = oracle[name]
        step = module.scales.float().t().repeat_interleave(module.group_size, dim=1).abs()  # [N, K]
        err = (module.dense_weight().float() - want).abs()
        assert bool((err <= 2**-11 * (16 * step + want.abs()) + 1e-7).all()), float((err / step).max())


def test_logits_match_transformers_on_the_same_file(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    path = write_tiny_gguf(tmp_path / "m.gguf", ALL_TYPES, tied=True)
    config, tensors = _read_gguf(str(path))
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(tensors, strict=False)
    hf.tie_weights()
    llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=16)
    ids = list(range(3, 60))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = llm.llm_engine.prompt_logits(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    info = llm.llm_engine.model_info()
    assert info["quantization"]["method"] == "gguf"
    assert info["weights"]["q_proj"] == "W4 (GGUF Q4_K, g32)"
    assert info["weights"]["lm_head"].startswith("tied to embed_tokens: W4 (GGUF Q4_0")


def test_fractional_zeros_fall_back_to_w8_exactly(tmp_path: Path) -> None:
    """Where fractional zero points are not allowed on W4 (``fractional_zeros_ok=False``; CUDA with W4 kernels
    that do not declare them), Q4_1/Q4_K load as W8 with the same values; Q4_0 (zero 8) stays W4."""
    path = write_tiny_gguf(tmp_path / "m.gguf", ALL_TYPES)
    w4, _ = _model(path)
    w8, report = _model(path, fractional_zeros_ok=False)
    m4, m8 = dict(w4.named_modules()), dict(w8.named_modules())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"):  # Q4_K, Q4_1
        assert isinstance(m8[name], W8A16Linear) and report[name].startswith("W8 (GGUF Q4_")
        torch.testing.assert_close(m8[name].dense_weight(), m4[name].dense_weight(), rtol=1e-6, atol=1e-7)
    assert isinstance(m8["model.layers.0.self_attn.k_proj"], W4A16Linear)  # Q4_0


def test_q4_1_and_q4_k_run_as_w4_on_cuda_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The W4 kernels declare exact fractional zero points, so a CUDA model keeps Q4_1 / Q4_K as W4 (0.5 bytes per
    weight, not W8's 1.25); kernels that did not declare it would get the W8 fallback."""
    from lightinfer.formats import gguf_load
    from lightinfer.kernels import w4a16_gemm

    assert w4a16_gemm.FRACTIONAL_ZEROS is True and gguf_load.w4_kernels_take_fractional_zeros()
    assert gguf_load.fractional_w4_allowed(torch.device("cuda")) and gguf_load.fractional_w4_allowed(torch.device("cpu"))
    monkeypatch.setattr(w4a16_gemm, "FRACTIONAL_ZEROS", False)
    assert not gguf_load.fractional_w4_allowed(torch.device("cuda")) and gguf_load.fractional_w4_allowed(
        torch.device("cpu"))


# q (Q4_K), k and v (Q4_0) fuse into one qkv GEMM, gate (Q4_1) and up (Q4_0) into gate_up; down is Q4_0 alone.
MIXED_W4 = {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q4_0, "attn_output": T.Q4_1, "ffn_gate": T.Q4_1,
            "ffn_up": T.Q4_0, "ffn_down": T.Q4_0, "token_embd": T.Q8_0, "output": T.Q4_K}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gguf_w4_layers_on_the_triton_kernels(tmp_path: Path, dtype: torch.dtype) -> None:
    """Every W4 layer of a GGUF model, fused as the engine fuses them, on the GPU code path (the Triton kernels on
    the interpreter): Q4_0 layers are marked integer_zeros (fp16: the pair decode), Q4_1 / Q4_K ones and GEMMs fused
    with one are not, and each layer's output equals the product with its dequantized weight, at M = 1 (GEMV)
    and M = 5 (tensor cores)."""
    from lightinfer.layers.fusion import fuse_model
    from lightinfer.layers.ops import triton_on_cpu

    path = write_tiny_gguf(tmp_path / "m.gguf", MIXED_W4)
    model, _ = _model(path, dtype)
    fuse_model(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    flags = {"qkv": attn.qkv_proj.integer_zeros, "o": attn.o_proj.integer_zeros,
             "gate_up": mlp.gate_up_proj.integer_zeros, "down": mlp.down_proj.integer_zeros,
             "lm_head": model.lm_head.table.integer_zeros}
    assert flags == {"qkv": False, "o": False, "gate_up": False, "down": True, "lm_head": False}
    gen = torch.Generator().manual_seed(0)
    for name, layer in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                        ("down", mlp.down_proj), ("lm_head", model.lm_head.table)):
        for m in (1, 5):
            x = torch.randn(m, layer.in_features, generator=gen).to(dtype)
            with triton_on_cpu():
                y = layer(x)
            y = (y.reduced() if hasattr(y, "reduced") else y).float()
            want = x.float() @ layer.dense_weight().float().T
            # fp16: the output's own rounding (and the weight operand's, 2^-11); fp32: summation order only
            err = float((y - want).norm() / want.norm())
            assert err < (2e-3 if dtype == torch.float16 else 1e-5), (name, m, err)


def test_dense_types_load_dense(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", {"attn_q": T.F16, "ffn_down": T.F32, "token_embd": T.F16})
    model, report = _model(path)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Linear)
    assert report["model.layers.0.self_attn.q_proj"] == "dense (GGUF F16)"
    assert report["model.embed_tokens"] == "dense (GGUF F16)"


# ------------------------------------------------------------------------------------ bad input
def test_unsupported_type_named_before_the_model_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", {"attn_v": T.Q2_K})
    built = []
    monkeypatch.setattr("lightinfer.engine.model_runner.ModelRunner.__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError) as e:
        LLM(str(path))
    msg = str(e.value)
    assert str(path) in msg and "blk.0.attn_v.weight" in msg and "Q2_K" in msg and "Q4_K" in msg and "Q8_0" in msg
    assert not built


def test_truncated_file_names_the_cut_tensor(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", ALL_TYPES)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 300_000])
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated: tensor blk\.\d+\.\w+\.weight"):
        Checkpoint(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:100])
    with pytest.raises(ValueError, match=r"header\.gguf is not a readable GGUF file"):
        Checkpoint(header_only)


def test_nan_block_scale_names_tensor_and_layer(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", ALL_TYPES)
    gf = open_gguf(str(path))
    t = gf.tensors["model.layers.1.mlp.up_proj.weight"]  # Q8_0: d is the first 2 bytes of each 34-byte block
    data = bytearray(path.read_bytes())
    data[t.offset + 34 * 3: t.offset + 34 * 3 + 2] = bytes.fromhex("007e")  # fp16 NaN
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"nan\.gguf: tensor blk\.1\.ffn_up\.weight \(Q8_0\).*NaN/inf.*layer "
                                         r"model\.layers\.1\.mlp\.up_proj"):
        LLM(str(bad), max_model_len=64, num_kv_blocks=8)
