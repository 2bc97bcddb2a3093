"""lightinfer's run-time kernels: Triton kernels with their launchers, and two PyTorch backends.

The public surface (what layers, models and the engine import; importing it does not import Triton):

* :class:`SplitKPartials`: a W4A16 GEMM's output left unreduced for the op that follows.
* :class:`KVCacheSpec`, :class:`PagedKV`, :data:`KV_BLOCK_SIZES`: the paged KV cache, one object per layer.
* :func:`get_backend`, :data:`BACKEND_NAMES`, :data:`OP_NAMES`: the ``triton``, ``torch_cpu`` and
  ``reference`` op backends (``backends.py``); :mod:`switches` for the ``LIGHTINFER_*`` kernel switches.
* The W4 run-time weight layout (``w4_layout.py``): :func:`repack_awq_to_runtime`, :func:`dequantize_w4`,
  :func:`pack_awq`, :func:`unpack_awq`, :func:`pack_int4_rows`, :func:`unpack_int4_rows`, :func:`zeros_are_integers`;
  the W8 one's :func:`dequantize_w8` (``reference.py``).
* :func:`decode_workspace_bytes`: the memory a split paged-attention decode allocates.
* :class:`ExpertWeights`: one linear of every expert of a MoE layer, stacked (``moe.py``), as the ``fused_moe``
  op takes it.
* Low-bit weights on the CPU (``cpu_lowbit.py``): :func:`prepare_w4_cpu` / :func:`prepare_w8_cpu` turn a W4 / W8
  run-time weight into a :class:`CpuQuantWeight` once, :func:`cpu_quant_linear` multiplies by it; an 8-bit LM
  head is requantized per row once (:func:`prepare_w8_per_channel_cpu`, :class:`CpuInt8Weight`) for
  :func:`cpu_int8_linear`.

Build-time tooling (SASS counts, shared-memory and PDL checks) lives in ``lightinfer.kernels.audit``, which
imports the kernels and is never imported by them. Engineering notes: ``kernels/README.md``.
"""

from __future__ import annotations

from . import switches
from .attention_plan import decode_workspace_bytes
from .backends import OP_NAMES, get_backend
from .cpu_lowbit import CpuInt8Weight, CpuQuantWeight
from .cpu_lowbit import int8_linear as cpu_int8_linear
from .cpu_lowbit import prepare_w4 as prepare_w4_cpu
from .cpu_lowbit import prepare_w8 as prepare_w8_cpu
from .cpu_lowbit import prepare_w8_per_channel as prepare_w8_per_channel_cpu
from .cpu_lowbit import quant_linear as cpu_quant_linear
from .moe import ExpertWeights
from .paged_kv import KV_BLOCK_SIZES, KVCacheSpec, PagedKV
from .reference import dequantize_w8
from .split_k import SplitKPartials
from .switches import BACKEND_NAMES
from .w4_layout import (
    dequantize_w4,
    pack_awq,
    pack_int4_rows,
    repack_awq_to_runtime,
    unpack_awq,
    unpack_int4_rows,
    zeros_are_integers,
)

__all__ = [
    "BACKEND_NAMES",
    "KV_BLOCK_SIZES",
    "OP_NAMES",
    "CpuInt8Weight",
    "CpuQuantWeight",
    "ExpertWeights",
    "KVCacheSpec",
    "PagedKV",
    "SplitKPartials",
    "cpu_int8_linear",
    "cpu_quant_linear",
    "decode_workspace_bytes",
    "dequantize_w4",
    "dequantize_w8",
    "get_backend",
    "pack_awq",
    "pack_int4_rows",
    "prepare_w4_cpu",
    "prepare_w8_cpu",
    "prepare_w8_per_channel_cpu",
    "repack_awq_to_runtime",
    "switches",
    "unpack_awq",
    "unpack_int4_rows",
    "zeros_are_integers",
]
