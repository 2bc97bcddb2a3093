"""Tiny GGUF files written with the ``gguf`` package for the tests: a random Llama whose tensors use
the GGML types under test, laid out as llama.cpp's converter lays them out (q/k rows permuted)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

VOCAB = 272
# Which GGML type each kind of tensor gets; K-quants need rows of 256 (hidden 256).
DEFAULT_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q4_1,
                 "ffn_gate": T.Q5_K, "ffn_up": T.Q8_0, "ffn_down": T.Q5_0, "token_embd": T.Q8_0, "output": T.Q6_K}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q/k weights (rotary halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(ggml_type: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of any K-quant: random bytes (every bit pattern is a valid block) with sane fp16 d/dmin."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (rows, cols // block)) * 2e-3).astype(np.float16).view(np.uint8).reshape(
        rows, cols // block, 2)
    if ggml_type == T.Q6_K:
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        raw[..., 2:4] = (d.view(np.float16) * np.float16(0.5)).view(np.uint8)  # dmin
    return raw.reshape(rows, -1)


def encode(w: np.ndarray, ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """``w`` (float32 [rows, cols]) as ``ggml_type`` bytes: the gguf package's quantizer where it has one."""
    if ggml_type in (T.F32, T.F16):
        return w.astype(np.float32 if ggml_type == T.F32 else np.float16)
    if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K):
        return random_blocks(ggml_type, *w.shape, rng)
    return quantize(w, ggml_type)


def write_tiny_gguf(path: Path, types: dict[str, T] | None = None, seed: int = 0, hidden: int = 256,
                    layers: int = 2, tied: bool = False) -> Path:
    """A random Llama GGUF at ``path``: 4 heads (head_dim 64), 2 KV heads, byte-level GPT-2 tokenizer."""
    types = {**DEFAULT_TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 2 * hidden
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_byte_tokenizer(w)

    def tensor(name: str, kind: str, shape: tuple[int, ...], scale: float = 0.05, permute: int = 0) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if permute:
            data = llama_cpp_permute(data, permute)
        w.add_tensor(name, encode(data, types.get(kind, T.F32), rng),
                     raw_dtype=None if types.get(kind, T.F32) in (T.F32, T.F16) else types[kind])

    tensor("token_embd.weight", "token_embd", (VOCAB, hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        tensor(f"blk.{i}.attn_q.weight", "attn_q", (heads * head_dim, hidden), permute=heads)
        tensor(f"blk.{i}.attn_k.weight", "attn_k", (kv_heads * head_dim, hidden), permute=kv_heads)
        tensor(f"blk.{i}.attn_v.weight", "attn_v", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", "attn_output", (hidden, heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        tensor(f"blk.{i}.ffn_gate.weight", "ffn_gate", (inter, hidden))
        tensor(f"blk.{i}.ffn_up.weight", "ffn_up", (inter, hidden))
        tensor(f"blk.{i}.ffn_down.weight", "ffn_down", (hidden, inter))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    if not tied:
        tensor("output.weight", "output", (VOCAB, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_qwen3moe_gguf(path: Path, types: dict[str, T] | None = None, seed: int = 0, hidden: int = 256,
                             layers: int = 2, experts: int = 4, top_k: int = 2, expert_ff: int = 256) -> Path:
    """A random Qwen3-MoE GGUF (llama.cpp's ``qwen3moe`` layout): experts stacked per projection in
    ``blk.N.ffn_{gate,up,down}_exps`` ``[E, N, K]``, the router ``ffn_gate_inp`` F32, q/k norms."""
    types = types or {}
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim = 4, 2, 64
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_name("tiny-qwen3moe")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(4 * hidden)
    w.add_expert_feed_forward_length(expert_ff)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_byte_tokenizer(w)

    def tensor(name: str, kind: str, shape: tuple[int, ...]) -> None:
        t = types.get(kind, T.F32)
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        rows = data.reshape(-1, shape[-1])
        w.add_tensor(name, encode(rows, t, rng).reshape(*shape[:-1], -1) if t not in (T.F32, T.F16)
                     else encode(rows, t, rng).reshape(shape), raw_dtype=None if t in (T.F32, T.F16) else t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    tensor("token_embd.weight", "token_embd", (VOCAB, hidden))
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", "attn_q", (heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_k.weight", "attn_k", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_v.weight", "attn_v", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", "attn_output", (hidden, heads * head_dim))
        norm(f"blk.{i}.attn_q_norm.weight", head_dim)
        norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        router = 0.1 * rng.standard_normal((experts, hidden))  # decisive routing, yet not chaotic under noise
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router.astype(np.float32))
        tensor(f"blk.{i}.ffn_gate_exps.weight", "ffn_gate_exps", (experts, expert_ff, hidden))
        tensor(f"blk.{i}.ffn_up_exps.weight", "ffn_up_exps", (experts, expert_ff, hidden))
        tensor(f"blk.{i}.ffn_down_exps.weight", "ffn_down_exps", (experts, hidden, expert_ff))
    norm("output_norm.weight", hidden)
    tensor("output.weight", "output", (VOCAB, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_byte_tokenizer(w: GGUFWriter) -> None:
    """GPT-2 byte-level tokenizer metadata with :data:`VOCAB` tokens (the 256 bytes as GPT-2's printable
    stand-ins, filler tokens, then <s> and </s>)."""
    from tokenizers import pre_tokenizers

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    w.add_tokenizer_model("gpt2")
    w.add_token_list(byte_chars + [f"<extra_{i}>" for i in range(VOCAB - 258)] + ["<s>", "</s>"])
    w.add_token_types([1] * (VOCAB - 2) + [3, 3])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
