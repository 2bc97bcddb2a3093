"""Weight bytes of a Llama-family model by part, from its config alone (no model is built, nothing is read):
what the memory plan, ``fit`` and the 12 GB advice need before a checkpoint is opened."""

from __future__ import annotations

from lightinfer.models.moe_spec import MoeSpec

# Parts, in the order a report lists them.
PARTS = ("embed_tokens", "lm_head", "attention", "mlp", "experts", "router and shared experts", "norms")


def linear_bytes(out_features: int, in_features: int, bits: int, group_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of one linear's weight: dense (``bits >= 16``: ``dtype_bytes`` per weight), or 4/8-bit codes plus a
    scale and a zero per group of ``group_size`` inputs, in ``dtype_bytes`` (the W4 run-time layout)."""
    n, k = int(out_features), int(in_features)
    if bits >= 16:
        return n * k * dtype_bytes
    return n * k * bits // 8 + 2 * max(1, k // group_size) * n * dtype_bytes


def llama_family_weight_bytes(c: object, moe: MoeSpec | None = None, bits: int = 16, group_size: int = 128,
                              dtype_bytes: int = 2, head_dim: int | None = None, qkv_bias: bool = False,
                              qk_norm: bool = False) -> dict[str, int]:
    """Bytes by part (:data:`PARTS`) of a Llama-family model (Llama, Mistral, Qwen2/3, and with ``moe`` the MoE
    families) with its decoder linears at ``bits`` (16: dense) and embedding, LM head, norms, biases, router and
    shared-expert gate in 16 bits (``dtype_bytes``), as ``quantize`` writes them. ``qkv_bias``: q/k/v have biases
    (Qwen2); ``qk_norm``: per-head q/k RMSNorms (Qwen3)."""
    h, layers = int(c.hidden_size), int(c.num_hidden_layers)
    hd = head_dim or (getattr(c, "head_dim", None) or h // c.num_attention_heads)
    q, kv = int(c.num_attention_heads) * hd, int(c.num_key_value_heads) * hd
    sparse = set(moe.sparse_layers(c)) if moe is not None else set()
    lin = lambda n, k: linear_bytes(n, k, bits, group_size, dtype_bytes)
    vocab_bytes = int(c.vocab_size) * h * dtype_bytes
    parts = dict.fromkeys(PARTS, 0)
    parts["embed_tokens"] = vocab_bytes
    parts["lm_head"] = 0 if getattr(c, "tie_word_embeddings", False) else vocab_bytes
    o_bias = bool(getattr(c, "attention_bias", False))
    biases = ((q + 2 * kv) if qkv_bias or o_bias else 0) + (h if o_bias else 0)
    parts["attention"] = layers * (lin(q, h) + 2 * lin(kv, h) + lin(h, q) + biases * dtype_bytes)
    parts["mlp"] = (layers - len(sparse)) * 3 * lin(int(c.intermediate_size), h)
    parts["norms"] = ((2 * layers + 1) * h + (2 * layers * hd if qk_norm else 0)) * dtype_bytes
    if sparse:
        e, i = moe.num_experts_of(c), int(getattr(c, moe.intermediate))
        parts["experts"] = len(sparse) * e * (2 * lin(i, h) + lin(h, i))
        shared = moe.shared_size(c)
        per_layer = e * h * dtype_bytes + (3 * lin(shared, h) + h * dtype_bytes if shared else 0)
        parts["router and shared experts"] = len(sparse) * per_layer
    return parts
