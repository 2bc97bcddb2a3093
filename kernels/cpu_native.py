"""The CPU engine's small per-layer ops in C (``native/cpu_decode_ops.c`` and the products beside it), compiled at
first use: the module state and the op wrappers.

At batch 1 a CPU decode step spends more time in the ~40 small torch ops per layer around its matrix products
(norms, RoPE, the KV store, the gather and SDPA of decode attention, SiLU·mul, the casts between them) than in
the products themselves (``docs/cpu_performance.md``). Each op here is one C call doing what those torch ops do,
with the same results up to fp32 summation order (``tests/kernels/test_cpu_native.py``):

* :func:`add_rms_norm`: the residual add and RMSNorm (``cpu_fused.fused_add_rms_norm`` / ``rms_norm``);
* :func:`qk_norm_`: the per-head q / k RMSNorm of Qwen3 and Gemma 3, in place;
* :func:`silu_mul`: ``silu(gate) * up`` in fp32, rounded once;
* :func:`rope_store`: RoPE of q and k, k and v written at their slots (bf16/fp32 or INT8 cache);
* :func:`attend_decode`: one query per sequence over its paged context, parallel over sequences and KV heads;
* :func:`w8_linear` (``native/cpu_w8.c``): an 8-bit weight with one scale per row (the LM head of
  ``cpu_lowbit.int8_linear``) times activations held as int16 per row;
* :func:`argmax_rows` (``native/cpu_sample.c``): the sampler's greedy pick, a row's first maximal index;
* :func:`w4_linear` (``native/cpu_w4a16.c``, ``native/cpu_w4a8.c``; the layouts in ``native/cpu_w4_layout.h``,
  written by :func:`w4_pack`): the 4-bit matrix product of ``cpu_lowbit.py``, activations held as int16 per
  block of 32 (the default; within ~1e-5 of the exact product), or, with ``LIGHTINFER_CPU_W4=int8``, quantized
  to int8 per block of 32, as llama.cpp does on the CPU (``cpu_lowbit.py`` says what that costs).

The contract with a recorded decode step (``engine/cpu_graph.py``): an op either makes its C call (:func:`_call`,
which appends it to the active :class:`~.native_record.Recording`) or declines with a reason (:func:`_decline`:
fp16 activations, partial rotary, a strided cache, ...), which the recording keeps and the caller answers by
running the torch ops; the graph runner names that reason when it refuses to replay the step. Outside a
recording a declined op returns None (False for :func:`qk_norm_`) and costs nothing more.

The build (``native_build.py``: compiler, flags, cache) and the ABI table (``native_abi.py``: argument types, the
KV-cache struct, binding) are their own modules; their public names are re-exported here. With no compiler, or
``LIGHTINFER_CPU_NATIVE=0``, every op takes the torch path and one log line says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import native_abi, native_pycall, switches
from .native_abi import DT_I8, DTYPES, LiKvCache, NativeOps, descriptor_args, pack_calls, pointer_args
from .native_build import (
    FLAGS,
    HEADERS,
    NATIVE_DIR,
    SOURCES,
    NativeBuildError,
    build,
    build_flags,
    cache_dir,
    compile_cached,
    cpu_flags,
    find_compiler,
    user_cache_dir,
)
from .native_record import Recording
from .paged_kv import PagedKV
from .step_memo import step_memo

__all__ = [
    "FLAGS",
    "HEADERS",
    "NATIVE_DIR",
    "SOURCES",
    "THREADED_OPS",
    "NativeBuildError",
    "NativeOps",
    "Recording",
    "add_rms_norm",
    "amx_available",
    "argmax_rows",
    "attend_decode",
    "bf16_gemm_native",
    "build",
    "build_flags",
    "cache_dir",
    "cpu_flags",
    "declined",
    "dense_gemm_dtype",
    "dense_path_native",
    "dense_rows",
    "descriptor_args",
    "find_compiler",
    "kv_descriptor",
    "library",
    "pack_calls",
    "pointer_args",
    "qk_norm_",
    "recording",
    "rope_store",
    "silu_mul",
    "user_cache_dir",
    "w4_linear",
    "w4_pack",
    "w8_linear",
]

logger = logging.getLogger("lightinfer")

_SIGNATURES = native_abi.SIGNATURES  # the ABI table, under the name tests and tools have used
_DTYPES = DTYPES
THREADED_OPS = native_abi.THREADED_OPS

_lock = threading.Lock()
_lib: NativeOps | None = None
_tried = False
_recording: Recording | None = None  # set while a decode step is recorded (:func:`recording`)
status = "not loaded"  # what happened at the first use: the library's path, or why the torch ops run


def library() -> NativeOps | None:
    """The loaded ops, built on the first call when no cached build fits; None when switched off
    (``LIGHTINFER_CPU_NATIVE=0``) or when they cannot be built or loaded (logged once, :data:`status`)."""
    global _lib, _tried, status
    if not switches.current().cpu_native:
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _load()
            status = str(_lib.path)
        except (NativeBuildError, OSError) as exc:
            status = f"torch ops (the C ops are unavailable: {exc})"
            logger.warning("lightinfer: the CPU's small ops run as torch ops, slower at small batches: %s", exc)
        _tried = True
    return _lib


def _load() -> NativeOps:
    """Build (or find the cached build of) the library and bind its ops (``native_build``, ``native_abi``)."""
    pycall = native_pycall.source(native_abi.SIGNATURES) if native_pycall.python_include() is not None else None
    path, with_module = compile_cached(find_compiler(), pycall)
    return native_abi.bind(path, with_module)


@contextlib.contextmanager
def recording(max_context: int) -> Iterator[Recording]:
    """Record the C ops this thread calls while inside (``engine/cpu_graph.py`` replays them).

    The ops run as usual and each call is appended to ``Recording.calls`` with its arguments; an op that
    declines notes why in ``Recording.declined``. What would make a recorded call wrong to repeat on other
    inputs is changed for the recording: work buffers are fresh tensors (owned by the capture, not the
    per-thread scratch that a later call may grow and free), and decode attention sizes its buffer for
    ``max_context`` tokens, not for the longest context of the step; the range checks the replay skips report
    their limits in ``Recording.bounds``.

    Raises:
        RuntimeError: the C ops are unavailable, or another recording is under way.
    """
    global _recording
    if library() is None:
        raise RuntimeError(f"the C ops are unavailable: {status}")
    with _lock:
        if _recording is not None:
            raise RuntimeError("a decode step is already being recorded")
        rec = _recording = Recording(max_context)
    try:
        yield rec
    finally:
        _recording = None


def _active() -> Recording | None:
    """The recording of this thread, if one is under way (the one place the ops look for it)."""
    rec = _recording
    return rec if rec is not None and rec.thread == threading.get_ident() else None


def _call(lib: NativeOps, name: str, *args: Any) -> None:
    """Make the C call ``name(*args)``, appended to the active recording (the one recording hook of the ops)."""
    getattr(lib, name)(*args)
    if _recording is not None and (rec := _active()) is not None:
        rec.record(name, args)


def _decline(op: str, reason: str) -> None:
    """The op ``op`` does not take this call (its caller runs torch ops instead): noted with ``reason`` in the
    active recording, which then cannot be replayed. Returns None, what a declining wrapper returns."""
    if _recording is not None and (rec := _active()) is not None:
        rec.decline(op, reason)


def declined(op: str, reason: str) -> None:
    """For a caller that does not even try the C op ``op`` (``torch_cpu``'s windowed or soft-capped attention):
    the same note as an op's own decline (:func:`_decline`)."""
    _decline(op, reason)


def _bound(name: str, limit: int) -> None:
    """Report an input limit that the replay of the active recording must check itself."""
    if _recording is not None and (rec := _active()) is not None:
        rec.bound(name, limit)


def _usable(*tensors: torch.Tensor) -> bool:
    for t in tensors:  # a loop, not all(generator): called several times per layer, per step
        if not (t.is_cpu and t.is_contiguous()) or t.requires_grad:
            return False
    return True


def _checked_once(kind: str, keys: tuple[torch.Tensor, ...], extra: tuple, check: Callable[[], Any]) -> Any:
    """``check()`` once per step for these tensors and the sizes in ``extra`` it also depends on (the step
    memo of ``step_memo.py``)."""
    rec = _active() if _recording is not None else None
    if rec is not None:
        with rec.checking():  # its torch ops are not part of the recorded step
            return step_memo.get(f"native:{kind}", keys, extra, check)
    return step_memo.get(f"native:{kind}", keys, extra, check)


def _threads() -> int:
    return torch.get_num_threads()


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x is None``: ``(rms_norm(residual) * weight, residual)``; else ``residual' = x + residual`` rounded to
    the dtype, ``(rms_norm(residual') * weight, residual')``. ``[..., hidden]`` fp32/bf16 (one dtype), weight
    ``[hidden]`` fp32/bf16. None where the C op does not apply."""
    lib = library()
    if lib is None:
        return None
    dt, wdt = DTYPES.get(residual.dtype), DTYPES.get(weight.dtype)
    if dt is None or wdt is None or (x is not None and x.dtype != residual.dtype):
        return _decline("add_rms_norm", f"{residual.dtype} activations with a {weight.dtype} weight")
    if not _usable(residual, weight, *(() if x is None else (x,))):
        return _decline("add_rms_norm", "a strided input")
    if (x is not None and x.shape != residual.shape) or weight.shape != residual.shape[-1:]:
        return _decline("add_rms_norm", "shapes that differ")
    h = residual.shape[-1]
    out = torch.empty_like(residual)
    new_residual = residual if x is None else torch.empty_like(residual)
    _call(lib, "li_add_rms_norm", None if x is None else x.data_ptr(), residual.data_ptr(),
          None if x is None else new_residual.data_ptr(), weight.data_ptr(), wdt, out.data_ptr(),
          residual.numel() // max(h, 1), h, eps, dt, _threads())
    return out, new_residual


def qk_norm_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
             eps: float) -> bool:
    """In place: each q head and each k head of a fused projection's ``qkv [T, (H + 2 Hkv) * D]`` (fp32/bf16, rows
    contiguous) RMS-normalized with ``q_weight`` / ``k_weight`` ``[D]`` (fp32/bf16, one dtype), as
    :func:`add_rms_norm` normalizes a row. Returns False, untouched, where the C op does not apply."""
    lib = library()
    if lib is None:
        return False
    dt, wdt = DTYPES.get(qkv.dtype), DTYPES.get(q_weight.dtype)
    d = q_weight.shape[-1]
    if dt is None or wdt is None or k_weight.dtype != q_weight.dtype:
        _decline("qk_norm", f"{qkv.dtype} activations with {q_weight.dtype} / {k_weight.dtype} weights")
        return False
    if qkv.dim() != 2 or qkv.stride(1) != 1 or not qkv.is_cpu or qkv.requires_grad or \
            not _usable(q_weight, k_weight):
        _decline("qk_norm", "a strided input")
        return False
    if q_weight.shape != (d,) or k_weight.shape != (d,) or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
        _decline("qk_norm", "q / k norm weights that are not one per head dim")
        return False
    _call(lib, "li_qk_norm", qkv.data_ptr(), dt, qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, d,
          q_weight.data_ptr(), k_weight.data_ptr(), wdt, eps, _threads())
    return True


def silu_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``x [..., 2 I]`` -> ``silu(x[..., :I]) * x[..., I:]`` in fp32, rounded once; None where it does not apply."""
    lib = library()
    if lib is None:
        return None
    dt = DTYPES.get(x.dtype)
    if dt is None:
        return _decline("silu_mul", f"{x.dtype} activations")
    if not _usable(x) or x.shape[-1] % 2:
        return _decline("silu_mul", "a strided or odd-width input")
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    _call(lib, "li_silu_mul", x.data_ptr(), out.data_ptr(), x.numel() // max(2 * inter, 1), inter, dt, _threads())
    return out


# PagedKV id -> (the object, its descriptor or None, why not): a layer's cache tensors live as long as the engine
_kv_args: dict[int, tuple[PagedKV, LiKvCache | None, str]] = {}
_kv_structs: dict[int, LiKvCache] = {}  # a descriptor's address -> the descriptor (kv_descriptor)


def _kv_struct(kv: PagedKV) -> tuple[LiKvCache | None, str]:
    """``(the cache's li_kv_cache, "")``, or ``(None, why)`` for a layout the C ops do not read (strided,
    fp16). Made once per cache object."""
    hit = _kv_args.get(id(kv))
    if hit is not None and hit[0] is kv:
        return hit[1], hit[2]
    cdt = DT_I8 if kv.is_int8 else DTYPES.get(kv.dtype)
    desc, why = None, ""
    if cdt is None:
        why = f"a {kv.dtype} KV cache"
    elif not _usable(*kv.tensors()):
        why = "a strided KV cache"
    else:
        desc = LiKvCache(kv.k.data_ptr(), kv.v.data_ptr(), *(t.data_ptr() if t is not None else None
                                                            for t in kv.scales),
                         cdt, kv.num_kv_heads, kv.head_dim, kv.block_size)
    if len(_kv_args) > 4096:  # caches of engines that are gone (a recorded graph keeps its own descriptors)
        _kv_args.clear()
        _kv_structs.clear()
    _kv_args[id(kv)] = (kv, desc, why)
    if desc is not None:
        _kv_structs[ctypes_address(desc)] = desc
    return desc, why


def ctypes_address(desc: LiKvCache) -> int:
    """The address of a descriptor, what the C ops take."""
    return ctypes.addressof(desc)


def kv_descriptor(address: int) -> LiKvCache | None:
    """The ``li_kv_cache`` at ``address`` that an op was passed (``engine/cpu_graph.py`` keeps it and checks the
    tensors it points to), or None when no op made one there."""
    return _kv_structs.get(address)


_scratch = threading.local()


def _scratch_buffer(numel: int) -> torch.Tensor:
    """A per-thread fp32 work buffer of at least ``numel`` values, kept between calls (while recording a
    fresh one each call: see :func:`recording`)."""
    if _recording is not None and _active() is not None:
        return torch.empty(max(numel, 1), dtype=torch.float32)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32)
    return buf


def rope_store(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
               cos_cache: torch.Tensor, sin_cache: torch.Tensor, kv: PagedKV,
               slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """``cpu_fused.rope_store_kvcache``: q ``[T, H, D]`` returned, k and v stored; the first
    ``R = 2 * cos_cache.shape[-1]`` dims of each head rotate (``R < D``: partial rotation), the others pass.
    None where it does not apply (fp16, non-int64 positions or slots, a strided input)."""
    lib = library()
    if lib is None:
        return None
    dt = DTYPES.get(qkv.dtype)
    d = kv.head_dim
    if dt is None:
        return _decline("rope_store", f"{qkv.dtype} activations")
    rot = cos_cache.shape[-1] * 2
    if cos_cache.dim() != 2 or rot > d or sin_cache.shape != cos_cache.shape:
        return _decline("rope_store", f"RoPE tables of {tuple(cos_cache.shape)} for heads of {d} dims")
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.requires_grad or \
            qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or num_kv_heads != kv.num_kv_heads:
        return _decline("rope_store", "a qkv that is not one row of whole heads per token")
    if cos_cache.dtype != torch.float32 or sin_cache.dtype != torch.float32 or positions.dtype != torch.int64 or \
            slot_mapping.dtype != torch.int64 or not _usable(positions, slot_mapping, cos_cache, sin_cache):
        return _decline("rope_store", "RoPE tables, positions or slots of another dtype or layout")
    desc, why = _kv_struct(kv)
    if desc is None:
        return _decline("rope_store", why)
    t = qkv.shape[0]
    limit = kv.num_blocks * kv.block_size
    # the C op indexes the tables and the cache with these: out of range would be out of bounds
    if not _checked_once("rope", (positions, slot_mapping, cos_cache), (t, limit), lambda: t == 0 or (
            positions.shape == (t,) and slot_mapping.shape == (t,) and int(positions.min()) >= 0 and
            int(positions.max()) < cos_cache.shape[0] and int(slot_mapping.max()) < limit)):
        return _decline("rope_store", "positions or slots out of range")
    _bound("positions", cos_cache.shape[0])
    _bound("slots", limit)
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype)
    _call(lib, "li_rope_store", qkv.data_ptr(), dt, t, qkv.stride(0), num_heads, rot, positions.data_ptr(),
          cos_cache.data_ptr(), sin_cache.data_ptr(), slot_mapping.data_ptr(), ctypes.addressof(desc), q.data_ptr(),
          _threads())
    return q


def attend_decode(q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float) -> torch.Tensor | None:
    """``torch_cpu.paged_attention_decode`` without a window or soft-cap: q ``[B, H, D]`` -> ``[B, H, D]``.
    None where it does not apply."""
    lib = library()
    if lib is None:
        return None
    dt = DTYPES.get(q.dtype)
    if dt is None:
        return _decline("attend_decode", f"{q.dtype} activations")
    if q.dim() != 3 or block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or \
            not _usable(q, block_tables, context_lens):
        return _decline("attend_decode", "block tables or lengths of another dtype or layout")
    desc, why = _kv_struct(kv)
    if desc is None:
        return _decline("attend_decode", why)
    b, h, d = q.shape
    if h % kv.num_kv_heads or d != kv.head_dim:
        return _decline("attend_decode", "query heads that do not match the cache's")
    if b == 0:
        return torch.empty_like(q)
    longest = _checked_once("attend", (block_tables, context_lens), (b, kv.block_size, kv.num_blocks),
                            lambda: _longest_context(kv, block_tables, context_lens, b))
    if longest < 0:
        return _decline("attend_decode", "block tables or lengths out of range")
    rec = _active() if _recording is not None else None
    if rec is not None:
        rec.bound("context", min(block_tables.shape[1] * kv.block_size, rec.max_context))
        rec.bound("blocks", kv.num_blocks)
        longest = max(longest, rec.max_context)  # the scratch holds any context a replay may have
    threads = _threads()
    g = h // kv.num_kv_heads
    scratch = _scratch_buffer(threads * (g * longest + 2 * g * d))
    out = torch.empty_like(q)
    _call(lib, "li_attend_decode", q.data_ptr(), dt, b, h, scale, block_tables.data_ptr(), block_tables.shape[1],
          context_lens.data_ptr(), ctypes.addressof(desc), out.data_ptr(), scratch.data_ptr(), longest, threads)
    return out


def _longest_context(kv: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor, b: int) -> int:
    """The longest context of a decode batch, or -1 when a table or length is out of range."""
    if block_tables.dim() != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        return -1
    longest, shortest = int(context_lens.max()), int(context_lens.min())
    if shortest < 1 or longest > block_tables.shape[1] * kv.block_size:
        return -1
    used = block_tables[:, : (longest + kv.block_size - 1) // kv.block_size]
    needed = torch.arange(used.shape[1]).unsqueeze(0) * kv.block_size < context_lens.unsqueeze(1)
    picked = used[needed]
    if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= kv.num_blocks):
        return -1
    return longest


W4_BLOCK = 32  # the activation block of the 4-bit product (int8, one scale per 32 values, as llama.cpp's Q8)
# From this many rows (a prefill) the weight is dequantized into a per-thread buffer and multiplied by torch's
# dense GEMM, where that is faster than the block dot products (bench/kernels/cpu_w4.py --gemm; the crossovers in
# docs/cpu_performance.md, "Measurements behind the C ops' choices"): to fp32 from W4_DENSE_ROWS rows (exact),
# to bf16 from W4_DENSE_ROWS_BF16 on a CPU that multiplies bf16 in hardware (bf16_gemm_native).
W4_DENSE_ROWS = 64
W4_DENSE_ROWS_BF16 = 24
# With AMX (amx_available) a bf16 input takes li_w4_amx_linear from W4_AMX_ROWS rows: it dequantizes each weight
# once per call into cache-resident tiles, about the same work at 5 rows as at 32, while the block products'
# work grows with the rows.
W4_AMX_ROWS = 5
W4_DENSE_FLOATS = 1 << 22  # the buffer's size cap (16 MB): larger layers are dequantized in slices of rows
_dense = threading.local()


def w4_pack(codes: torch.Tensor) -> torch.Tensor | None:
    """uint8 codes ``[N, K]`` (0..15, one per byte) -> the 4-bit products' layout, uint8 ``[N, K / 2]``
    (``native/cpu_w4_layout.h``: blocks of 32 codes interleaved by 8, so that each int32 lane of a 32-byte
    vector holds 4 codes of one block). None without the C library or when K is not a multiple of 32."""
    lib = library()
    if lib is None:
        return None
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] % W4_BLOCK or not _usable(codes):
        return _decline("w4_pack", "codes that are not uint8 [N, K] with K a multiple of 32")
    packed = torch.empty(codes.shape[0], codes.shape[1] // 2, dtype=torch.uint8)
    _call(lib, "li_w4_pack", codes.data_ptr(), packed.data_ptr(), codes.shape[0], codes.shape[1])
    return packed


def w4_linear(x: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, out_dtype: torch.dtype, int8_activations: bool = False) -> torch.Tensor | None:
    """``y = x W^T (+ bias)`` with ``W = d * q + m`` per group of ``group_size`` along K, fp32 sums.

    Below :func:`dense_rows` rows integer dot products take ``x`` quantized per block of 32 along K: to int16
    by ``native/cpu_w4a16.c`` (within ~1e-5 of the exact product), or with ``int8_activations`` to int8 by
    ``native/cpu_w4a8.c`` (llama.cpp's Q4_1 x Q8 scheme); the offset term uses the exact fp32 sums of x
    (``reference.w4_act_gemm`` is the twin). From :func:`dense_rows` rows on, ``W`` is dequantized (slices of
    rows into a per-thread buffer of at most :data:`W4_DENSE_FLOATS` values) and torch's dense GEMM multiplies
    with ``x`` as it is: in fp32 (exact), or for a bf16 ``x`` on a CPU with bf16 hardware
    (:func:`bf16_gemm_native`) in bf16 with fp32 sums, the weight rounded to bf16 (~0.1% of each value).

    Args:
        x: ``[M, K]`` fp32 / bf16, contiguous.
        packed: uint8 ``[N, K / 2]`` from :func:`w4_pack`.
        dm: fp16 ``[N, 2, K / group_size]``: per row the group scales d, then the offsets m.
        group_size: a multiple of 32 dividing K.
        bias: fp32 ``[N]`` or None.
        out_dtype: fp32 or bf16.
        int8_activations: int8 activations (``LIGHTINFER_CPU_W4=int8``) instead of int16.
    Returns:
        ``[M, N]`` in ``out_dtype``, or None where the C op does not apply (the caller's other path runs).
    """
    lib = library()
    if lib is None:
        return None
    xdt, ydt = DTYPES.get(x.dtype), DTYPES.get(out_dtype)
    if xdt is None or ydt is None:
        return _decline("w4_linear", f"{x.dtype} activations")
    if x.dim() != 2 or not _usable(x) or (bias is not None and (bias.dtype != torch.float32 or not _usable(bias))):
        return _decline("w4_linear", "a strided input or a bias that is not fp32")
    m, k = x.shape
    n = packed.shape[0]
    if m >= dense_rows(x.dtype):
        if not dense_path_native(x.dtype):
            _decline("w4_linear", f"{m} rows take torch's dense GEMM (from {dense_rows(x.dtype)} rows)")
        return _w4_dense(lib, x, packed, dm, group_size, bias, out_dtype)
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    # the quantized input: int8 / int16 values (4-byte aligned), then fp32 block scales and block sums
    nb, size = k // W4_BLOCK, 1 if int8_activations else 2
    work = _scratch_buffer((m * k * size + 3) // 4 + 2 * m * nb)
    _call(lib, "li_w4a8_linear" if int8_activations else "li_w4a16_linear", x.data_ptr(), xdt, m, k,
          packed.data_ptr(), dm.data_ptr(), group_size, n, None if bias is None else bias.data_ptr(), y.data_ptr(),
          ydt, work.data_ptr(), _threads())
    return y


@functools.cache
def bf16_gemm_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 ``avx512_bf16`` or ``amx_bf16`` in :func:`cpu_flags`),
    where torch's bf16 GEMM (oneDNN) is several times its fp32 GEMM at a prefill's shapes (``bench/kernels/cpu_w4.py
    --gemm``); without them oneDNN converts bf16 in software and fp32 is the safe choice."""
    flags = cpu_flags()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.backends.mkldnn.is_available()


def dense_gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the dense path's GEMM for an input of ``dtype``: bf16 for a bf16 input where
    :func:`bf16_gemm_native`, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 and bf16_gemm_native() else torch.float32


def dense_rows(dtype: torch.dtype) -> int:
    """The rows from which :func:`w4_linear` of an input of ``dtype`` takes the dense path."""
    if dense_path_native(dtype):
        return W4_AMX_ROWS
    return W4_DENSE_ROWS_BF16 if dense_gemm_dtype(dtype) == torch.bfloat16 else W4_DENSE_ROWS


def dense_path_native(dtype: torch.dtype) -> bool:
    """Whether the dense path of :func:`w4_linear` for an input of ``dtype`` is a C op (AMX), which a recorded
    decode step can replay; torch's GEMM cannot be."""
    return dtype == torch.bfloat16 and amx_available()


@functools.cache
def _amx_granted() -> bool:
    lib = library()
    if lib is None:
        return False
    ok = torch.zeros(1, dtype=torch.int32)
    lib.li_w4_amx_init(ok.data_ptr())  # not through _call: never part of a recording
    return bool(ok.item())


def amx_available() -> bool:
    """Whether a bf16 4-bit product of many rows runs on AMX tiles (``native/cpu_w4_amx.c``): the library was
    built for a CPU with AMX-BF16, Linux granted the tile registers, and ``LIGHTINFER_CPU_AMX`` is not 0."""
    return switches.current().cpu_amx and _amx_granted()


def _w4_dense(lib: NativeOps, x: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`w4_linear` for many rows: bf16 x bf16 products with fp32 sums (the weight rounded to bf16) on AMX
    tiles where :func:`amx_available`; else the weight dequantized by slices for torch's dense GEMM, ``x``
    unrounded, in :func:`dense_gemm_dtype`: bf16 x bf16 (the weight rounded to bf16, fp32 sums) or fp32."""
    if dense_path_native(x.dtype):
        m, k = x.shape
        n, threads = packed.shape[0], _threads()
        y = torch.empty(m, n, dtype=out_dtype)
        work = _scratch_buffer(((m + 15) // 16 * 16 + 32 * threads) * k // 2)  # 16-bit values: x in tiles, W's rows
        _call(lib, "li_w4_amx_linear", x.data_ptr(), m, k, packed.data_ptr(), dm.data_ptr(), group_size, n,
              None if bias is None else bias.data_ptr(), y.data_ptr(), DTYPES[out_dtype], work.data_ptr(), threads)
        return y
    k, n = x.shape[1], packed.shape[0]
    rows = max(16, min(n, W4_DENSE_FLOATS // k))  # output rows dequantized at a time: bounded memory
    gemm = dense_gemm_dtype(x.dtype)
    buf = getattr(_dense, "buf", None)
    if buf is None or buf.numel() < rows * k or buf.dtype != gemm:
        buf = _dense.buf = torch.empty(rows * k, dtype=gemm)
    xg = x.to(gemm)
    parts = []
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = buf[: (n1 - n0) * k].view(n1 - n0, k)
        _call(lib, "li_w4_dequant", packed[n0:n1].data_ptr(), dm[n0:n1].data_ptr(), group_size, n1 - n0, k,
              w.data_ptr(), DTYPES[gemm], _threads())
        b = None if bias is None else bias[n0:n1]
        part = torch.nn.functional.linear(xg, w, b if gemm == torch.float32 else None)
        if b is not None and gemm != torch.float32:
            part = part.float() + b  # the fp32 bias, not rounded to bf16 first
        parts.append(part.to(out_dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def w8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor | None:
    """``y = x W^T (+ bias)`` with ``W = scales[:, None] * qweight`` (``native/cpu_w8.c``): ``x`` quantized to
    int16 with one scale per row (``max |x| / 32767``), int32 dot products, fp32 scaling; within ~1e-5 of the
    exact product with the same weight (twin ``reference.w8_rows_gemm``).

    Args:
        x: ``[M, K]`` fp32 / bf16, contiguous.
        qweight: int8 ``[N, K]``, contiguous, K a multiple of 32.
        scales: bf16 ``[N]``.
        bias: fp32 ``[N]`` or None.
        out_dtype: fp32 or bf16.
    Returns:
        ``[M, N]`` in ``out_dtype``, or None where the C op does not apply (the caller's other path runs).
    """
    lib = library()
    if lib is None:
        return None
    xdt, ydt = DTYPES.get(x.dtype), DTYPES.get(out_dtype)
    if xdt is None or ydt is None:
        return _decline("w8_linear", f"{x.dtype} activations")
    if x.dim() != 2 or not _usable(x, qweight, scales) or (bias is not None and (bias.dtype != torch.float32 or
                                                                                 not _usable(bias))):
        return _decline("w8_linear", "a strided input or a bias that is not fp32")
    if qweight.dtype != torch.int8 or scales.dtype != torch.bfloat16 or qweight.shape[1] % W4_BLOCK or \
            x.shape[1] != qweight.shape[1]:
        return _decline("w8_linear", "a weight that is not int8 [N, K] with bf16 scales and K a multiple of 32")
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    work = _scratch_buffer((m * k * 2 + 3) // 4 + m + 1)  # int16 values (4-byte aligned), then a scale per row
    _call(lib, "li_w8_linear", x.data_ptr(), xdt, m, k, qweight.data_ptr(), scales.data_ptr(), n,
          None if bias is None else bias.data_ptr(), y.data_ptr(), ydt, work.data_ptr(), _threads())
    return y


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` for fp32 ``x [rows, n]`` (``native/cpu_sample.c``): the first index of each row's
    maximum, or of its first NaN, as torch's; int64 ``[rows]``. None where it does not apply (not fp32, not 2-D
    and contiguous, no C library)."""
    lib = library()
    if lib is None:
        return None
    if x.dtype != torch.float32 or x.dim() != 2 or not _usable(x) or x.shape[1] == 0:
        return _decline("argmax_rows", "logits that are not fp32 [rows, n], contiguous")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _call(lib, "li_argmax_rows", x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), _threads())
    return out
