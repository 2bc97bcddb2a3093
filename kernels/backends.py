"""The three op backends, by name: each a module exposing the same functions with the same signatures.

==============  =============================  ==============================================================
name            module                         what it is
==============  =============================  ==============================================================
``triton``      ``kernels/triton_ops.py``      the Triton launchers (CUDA; CPU under ``TRITON_INTERPRET=1``)
``torch_cpu``   ``kernels/torch_cpu.py``       the CPU engine's fast PyTorch code (grouped decode, SDPA)
``reference``   ``kernels/reference.py``       naive PyTorch, the oracle the other two are tested against
==============  =============================  ==============================================================

:data:`OP_NAMES` lists the functions every backend has. ``lightinfer.layers.ops.ops_for`` chooses the
backend for a tensor; ``LIGHTINFER_BACKEND`` (``switches.py``) forces one. Modules are imported on first
use, so asking for ``torch_cpu`` or ``reference`` never imports Triton.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .switches import BACKEND_NAMES

_MODULES = {"triton": "triton_ops", "torch_cpu": "torch_cpu", "reference": "reference"}
assert tuple(_MODULES) == BACKEND_NAMES

# The ops every backend module defines, with one signature per name (tests/kernels/test_backends.py checks).
OP_NAMES = (
    "w4a16_gemm",
    "w8a16_gemm",
    "store_kvcache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "varlen_causal_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "qk_rms_norm_",
    "rotary_qk",
    "rope_store_kvcache",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "fused_moe",
)

_loaded: dict[str, ModuleType] = {}


def get_backend(name: str) -> ModuleType:
    """The backend module called ``name`` (one of :data:`BACKEND_NAMES`), imported on first use.

    Raises:
        ValueError: ``name`` is not a backend.
    """
    module = _loaded.get(name)
    if module is None:
        if name not in _MODULES:
            raise ValueError(f"no kernel backend {name!r}; the backends are {', '.join(BACKEND_NAMES)}")
        module = _loaded[name] = importlib.import_module(f".{_MODULES[name]}", __package__)
    return module
