"""The C ops' ABI: their argument types (:data:`SIGNATURES`), the dtype codes, the KV-cache descriptor struct,
and the binding of a built library to Python callables.

One table serves three readers: ctypes (each function's ``argtypes``), the generated extension module of
direct entry points (``native_pycall.source``) and the packed calls that ``li_replay`` makes for a recorded
decode step (:func:`pack_calls`; ``engine/cpu_graph.py`` rewrites the pointer arguments, :func:`pointer_args`,
and keeps the descriptors, :func:`descriptor_args`). A change here must match the C declaration
(``native/*.c``) argument for argument.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace

import torch

from . import native_pycall

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # activation / cache dtype codes (DT_F32, DT_BF16 in the C ops)
DT_I8 = 2  # an INT8 KV cache (per token and head scales and zeros)


class KvCacheRef(ctypes.c_void_p):
    """The address of a :class:`LiKvCache` (a pointer argument whose memory is not a tensor: a recorded step
    keeps the struct itself, its pointers are the cache's tensors)."""


class LiKvCache(ctypes.Structure):
    """``li_kv_cache`` of ``native/cpu_kv_cache.h``: one layer's paged cache as the C ops read it."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
                ("k_zero", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("v_zero", ctypes.c_void_p),
                ("dtype", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("block_size", ctypes.c_int32)]

    def pointers(self) -> tuple[int, ...]:
        """The tensor addresses it holds (0 for NULL)."""
        return tuple(getattr(self, name) or 0 for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"))


_P, _I, _F, _L, _KV = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long, KvCacheRef
SIGNATURES: dict[str, tuple[type, ...]] = {
    "li_add_rms_norm": (_P, _P, _P, _P, _I, _P, _I, _I, _F, _I, _I),
    "li_qk_norm": (_P, _I, _I, _L, _I, _I, _I, _P, _P, _I, _F, _I),
    "li_silu_mul": (_P, _P, _I, _I, _I, _I),
    "li_rope_store": (_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _KV, _P, _I),
    "li_attend_decode": (_P, _I, _I, _I, _F, _P, _I, _P, _KV, _P, _P, _I, _I),
    "li_w4_pack": (_P, _P, _L, _I),
    "li_w4a16_linear": (_P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I),
    "li_w4a8_linear": (_P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I),
    "li_w4_dequant": (_P, _P, _I, _I, _I, _P, _I, _I),
    "li_w4_amx_init": (_P,),
    "li_w4_amx_linear": (_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I),
    "li_w8_linear": (_P, _I, _I, _I, _P, _P, _I, _P, _P, _I, _P, _I),
    "li_argmax_rows": (_P, _I, _L, _P, _I),
}
# the ops whose last argument is the thread count (torch.get_num_threads() at the call); work buffers are sized
# for it, so a recorded call may be repeated with fewer threads, never more (engine/cpu_graph.py)
THREADED_OPS = frozenset(SIGNATURES) - {"li_w4_pack", "li_w4_amx_init"}


class NativeOps(SimpleNamespace):
    """The C ops by name (``li_add_rms_norm``, ...): each the extension module's direct entry point where the
    library has one (``native_pycall.py``), else the ctypes function; the same arguments either way (ints for
    pointers, None for NULL). ``path``: the library; ``direct``: whether the direct entry points serve;
    ``replay``: the module's ``li_replay`` for :func:`pack_calls`' buffers (None without the module)."""


def bind(path: Path, with_module: bool) -> NativeOps:
    """The ops of the built library ``path``; ``with_module``: it also holds the extension module.

    Raises:
        OSError: the library does not load.
    """
    lib = ctypes.CDLL(str(path))
    module = native_pycall.load(path) if with_module else None
    ops = NativeOps(path=path, direct=module is not None)
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
        setattr(ops, name, getattr(module, name) if module is not None else fn)
    ops.replay = getattr(module, "li_replay", None)  # packed calls (pack_calls), where the module serves
    return ops


def pack_calls(calls: list[tuple[str, tuple]]) -> torch.Tensor:
    """``(op name, arguments)`` calls packed for ``library().replay(packed.data_ptr(), len(calls))``, which makes
    them in order with the GIL released once (``native_pycall.pack_calls``): uint8."""
    return torch.frombuffer(native_pycall.pack_calls(SIGNATURES, calls), dtype=torch.uint8)


def pointer_args(name: str) -> tuple[int, ...]:
    """The positions of the tensor pointer arguments of the C op ``name`` (a key of :data:`SIGNATURES`)."""
    return tuple(i for i, t in enumerate(SIGNATURES[name]) if t is _P)


def descriptor_args(name: str) -> tuple[int, ...]:
    """The positions of the arguments of the C op ``name`` that are the address of a :class:`LiKvCache`."""
    return tuple(i for i, t in enumerate(SIGNATURES[name]) if t is _KV)
