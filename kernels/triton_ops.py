"""The ``triton`` backend: the Triton launchers under the op names every backend shares (``backends.OP_NAMES``).

Importing this module imports Triton (seconds on a CPU); ``backends.get_backend("triton")`` does it on
first use. Tensors must be on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` (Triton's
interpreter: tests). Cache-free attention has no kernel of ours: it is torch's SDPA (``sdpa.py``).
"""

from __future__ import annotations

import torch

from .fused_moe import fused_moe
from .kv_store import store_kvcache
from .norm_rope import fused_add_rms_norm, gelu_tanh_and_mul, rms_norm, rotary_qk, silu_and_mul
from .paged_attention import paged_attention_decode, paged_attention_prefill
from .rope_store import rope_store_kvcache
from .sdpa import varlen_causal_attention
from .w4a16_gemm import w4a16_gemm
from .w8a16_gemm import w8a16_gemm

__all__ = ["fused_add_rms_norm", "fused_moe", "gelu_tanh_and_mul", "paged_attention_decode", "paged_attention_prefill",
           "qk_rms_norm_", "rms_norm", "rope_store_kvcache", "rotary_qk", "silu_and_mul", "store_kvcache", "varlen_causal_attention",
           "w4a16_gemm", "w8a16_gemm"]


def qk_rms_norm_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float) -> bool:
    """``reference.qk_rms_norm_``, declined: on the GPU the model norms the split q/k heads with :func:`rms_norm`
    and rotates them with :func:`rotary_qk` (returns False, ``qkv`` untouched)."""
    return False
