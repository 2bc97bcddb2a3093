"""Gemma 2 and Phi-3 GGUF files (llama.cpp's tensor names and layouts: Gemma's norms stored as ``1 + w``,
Phi-3's ``attn_qkv`` and fused ``ffn_up``, LongRoPE factors as tensors) load through the GGUF loader with 4-
and 8-bit tensors kept quantized, and give what transformers computes from the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from lightinfer import LLM
from tests.formats.gguf_files import VOCAB, add_byte_tokenizer, encode

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 256, 4, 2, 64, 512, 2


def _header(w: GGUFWriter) -> None:
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_byte_tokenizer(w)
    w.add_pad_token_id(0)


LONG = [1.5 + 0.25 * i for i in range(24)]  # LongRoPE factors of a 48-dim rotation (Phi-4-mini's 3/4 of 64)
SHORT = [1.0 + 0.02 * i for i in range(24)]


def write_gguf(path: Path, arch: str, seed: int = 0) -> Path:
    """A random 2-layer ``gemma2`` or ``phi3`` GGUF: Q4_0 / Q4_1 / Q8_0 matrices, F32 norms; the phi3 one with
    LongRoPE factors (original length 64) and a 3/4 partial rotation, as llama.cpp writes Phi-4-mini."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    _header(w)
    if arch == "gemma2":
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_sliding_window(24)
    else:
        w.add_rope_dimension_count(HEAD_DIM * 3 // 4)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_tensor("rope_factors_long.weight", np.array(LONG, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(SHORT, dtype=np.float32))

    def mat(name: str, rows: int, cols: int, ggml_type: T) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(name, encode(data, ggml_type, rng), raw_dtype=None if ggml_type == T.F32 else ggml_type)

    def norm(name: str) -> None:  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(name, ((1.0 if arch == "gemma2" else 0.0) + 1 + 0.1 * rng.standard_normal(HIDDEN)).astype(
            np.float32))

    mat("token_embd.weight", VOCAB, HIDDEN, T.Q8_0)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        mat(f"blk.{i}.attn_output.weight", HIDDEN, q, T.Q4_1)
        mat(f"blk.{i}.ffn_down.weight", HIDDEN, INTER, T.Q4_0)
        if arch == "gemma2":
            norm(f"blk.{i}.post_attention_norm.weight")
            norm(f"blk.{i}.post_ffw_norm.weight")
            mat(f"blk.{i}.attn_q.weight", q, HIDDEN, T.Q4_0)
            mat(f"blk.{i}.attn_k.weight", kv, HIDDEN, T.Q4_1)
            mat(f"blk.{i}.attn_v.weight", kv, HIDDEN, T.Q8_0)
            mat(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN, T.Q4_0)
            mat(f"blk.{i}.ffn_up.weight", INTER, HIDDEN, T.Q4_0)
        else:
            mat(f"blk.{i}.attn_qkv.weight", q + 2 * kv, HIDDEN, T.Q4_0)
            mat(f"blk.{i}.ffn_up.weight", 2 * INTER, HIDDEN, T.Q4_1)  # gate rows, then up rows
    norm("output_norm.weight")
    if arch == "phi3":
        mat("output.weight", VOCAB, HIDDEN, T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_gguf_loads_quantized_and_matches_transformers(tmp_path: Path, arch: str) -> None:
    import transformers

    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32, max_num_batched_tokens=32)
    weights = llm.llm_engine.model_info()["weights"]
    assert any("W4" in v for v in weights.values()) and any("W8" in v for v in weights.values()), weights
    from lightinfer.loader import _read_gguf

    # transformers' own GGUF reader (config, every tensor dequantized and processed) into its own model
    config, tensors = _read_gguf(str(path))
    config._attn_implementation = "eager"
    if arch == "phi3":  # what the file says, which transformers' GGUF config reader leaves out (gguf_rope.py)
        config.partial_rotary_factor, config.original_max_position_embeddings = 0.75, 64
        config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "long_factor": LONG, "short_factor": SHORT, "original_max_position_embeddings": 64}
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    assert type(hf).__name__ == {"gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM"}[arch]
    # past Gemma's window, and past Phi's original length (LongRoPE's long factors)
    ids = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = llm.llm_engine.prompt_logits(ids)
    # the 4-bit layers run from their codes, transformers from its fp32 dequantization: rounding only
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
