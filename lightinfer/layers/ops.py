"""Device dispatch: the Triton launchers on CUDA, their plain-PyTorch twins elsewhere.

Layers call ``ops_for(x).<name>(...)``; both modules expose the same functions with the
same signatures (``kernels/reference.py`` documents them).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

import torch

from lightinfer.kernels import reference


@functools.lru_cache(maxsize=1)
def _triton_ops() -> types.SimpleNamespace:
    # Imported lazily: importing Triton costs seconds and is useless on a CPU.
    from lightinfer.kernels import kv_store, norm_rope, paged_attention, rope_store, w4a16_gemm

    return types.SimpleNamespace(
        w4a16_gemm=w4a16_gemm.w4a16_gemm,
        store_kvcache=kv_store.store_kvcache,
        paged_attention_decode=paged_attention.paged_attention_decode,
        paged_attention_prefill=paged_attention.paged_attention_prefill,
        varlen_causal_attention=reference.varlen_causal_attention,
        rms_norm=norm_rope.rms_norm,
        fused_add_rms_norm=norm_rope.fused_add_rms_norm,
        rotary_qk=norm_rope.rotary_qk,
        rope_store_kvcache=rope_store.rope_store_kvcache,
        silu_and_mul=norm_rope.silu_and_mul,
    )


_triton_on_cpu = False


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Inside this block CPU tensors take the Triton kernels too, which then run on Triton's CPU
    interpreter (``TRITON_INTERPRET=1`` must be set): the GPU code path of a whole model, end to
    end, on a machine without a GPU. For tests; slow. Not thread-safe (a module flag)."""
    global _triton_on_cpu
    previous, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = previous


def uses_triton(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` run the Triton kernels: on CUDA, or on CPU inside :func:`triton_on_cpu`."""
    return x.is_cuda or _triton_on_cpu


def ops_for(x: torch.Tensor) -> types.SimpleNamespace | types.ModuleType:
    """The kernel namespace for ``x``: Triton on CUDA (see :func:`uses_triton`), ``kernels.reference`` otherwise."""
    if uses_triton(x):
        return _triton_ops()
    return reference
