"""The CPU engine's small per-layer ops in C (``native/cpu_decode_ops.c``), compiled at first use.

At batch 1 a CPU decode step spends more time in the ~40 small torch ops per layer around its matrix
products (norms, RoPE, the KV store, the gather and SDPA of decode attention, SiLU·mul, the casts
between them) than in the products themselves: ~16 of a 30 ms step on a 2-core AVX2 EPYC
(``bench/kernels/cpu_step_floor.py``). Each op here is one C call doing what those torch ops do, with the same
results up to fp32 summation order (``tests/kernels/test_cpu_native.py``):

* :func:`add_rms_norm`: the residual add and RMSNorm (``cpu_fused.fused_add_rms_norm`` / ``rms_norm``);
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

Each returns None where it does not apply (fp16 activations, partial rotary, a strided cache, ...) and the
caller runs the torch ops instead. The library is built once per source, compiler and CPU with the system's
C compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``: ``-O3 -march=native``, OpenMP when available, about
a second) into ``$XDG_CACHE_HOME/lightinfer/native`` (``~/.cache``); with no compiler, or
``LIGHTINFER_CPU_NATIVE=0``, every op takes the torch path and one log line says why. Where the Python headers
are installed the library also holds a CPython extension module generated from :data:`_SIGNATURES`
(``native_pycall.py``), whose functions :func:`library` returns: a tenth of a ctypes call's cost.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from . import native_pycall, switches
from .native_record import Recording
from .paged_kv import PagedKV
from .step_memo import step_memo

logger = logging.getLogger("lightinfer")

NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCES = tuple(NATIVE_DIR / name for name in ("cpu_decode_ops.c", "cpu_w4_pack.c", "cpu_w4a16.c", "cpu_w4a8.c",
                                                "cpu_w8.c", "cpu_sample.c", "cpu_w4_amx.c"))
HEADERS = (NATIVE_DIR / "cpu_convert.h", NATIVE_DIR / "cpu_w4_layout.h", NATIVE_DIR / "cpu_w4_dequant.h")  # included: part of the build's cache key
# -mprefer-vector-width=512: gcc's -march=native vectorises loops in 256-bit registers on Intel CPUs with
# AVX-512; the C ops' plain loops (norms, SiLU, decode attention) in 512-bit ones served 16 sequences ~8% faster
# (SmolLM2, Sapphire Rapids Xeon, 2 threads, 2026-12-06: 65 tokens each in 2.61 / 2.58 / 2.66 s against
# 2.89 / 2.84 / 2.81 s, alternating builds). Ignored by CPUs without AVX-512.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fno-strict-aliasing", "-shared", "-fPIC",
         *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()))
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_I8 = 2
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "li_add_rms_norm": (_P, _P, _P, _P, _I, _P, _I, _I, _F, _I, _I),
    "li_qk_norm": (_P, _I, _I, ctypes.c_long, _I, _I, _I, _P, _P, _I, _F, _I),
    "li_silu_mul": (_P, _P, _I, _I, _I, _I),
    "li_rope_store": (_P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I),
    "li_attend_decode": (_P, _I, _I, _I, _I, _I, _F, _P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I),
    "li_w4_pack": (_P, _P, ctypes.c_long, _I),
    "li_w4a16_linear": (_P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I),
    "li_w4a8_linear": (_P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I),
    "li_w4_dequant": (_P, _P, _I, _I, _I, _P, _I, _I),
    "li_w4_amx_init": (_P,),
    "li_w4_amx_linear": (_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I),
    "li_w8_linear": (_P, _I, _I, _I, _P, _P, _I, _P, _P, _I, _P, _I),
    "li_argmax_rows": (_P, _I, ctypes.c_long, _P, _I),
}
# the ops whose last argument is the thread count (torch.get_num_threads() at the call); work buffers are sized
# for it, so a recorded call may be repeated with fewer threads, never more (engine/cpu_graph.py)
THREADED_OPS = frozenset(_SIGNATURES) - {"li_w4_pack", "li_w4_amx_init"}

_lock = threading.Lock()
_lib: NativeOps | None = None
_tried = False
_recording: Recording | None = None  # set while a decode step is recorded (:func:`recording`)
status = "not loaded"  # what happened at the first use: the library's path, or why the torch ops run


class NativeBuildError(RuntimeError):
    """The C compiler failed; the message holds its command and output."""


def user_cache_dir() -> Path:
    """lightinfer's cache folder: ``$XDG_CACHE_HOME/lightinfer`` or ``~/.cache/lightinfer``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightinfer"


def cache_dir() -> Path:
    """Where the compiled ops are kept: ``native`` in :func:`user_cache_dir`."""
    return user_cache_dir() / "native"


def find_compiler() -> str | None:
    """``$CC`` if set, else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``; None when there is none."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"]) or os.environ["CC"]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's flags (Linux) or its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_flags() -> tuple[str, ...]:
    """The compiler flags of the C ops: :data:`FLAGS` with ``-march`` set by ``LIGHTINFER_CPU_MARCH``."""
    march = switches.current().cpu_march
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


# the compiler's macro of an instruction set -> its Linux /proc/cpuinfo flag (those that choose a path here)
_MACRO_FLAGS = {"__AVX2__": "avx2", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw",
                "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16", "__AMX_BF16__": "amx_bf16",
                "__AMX_TILE__": "amx_tile", "__AVXVNNI__": "avx_vnni", "__AVX512VBMI__": "avx512vbmi"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction sets the paths are chosen for: this CPU's Linux flags, or with ``LIGHTINFER_CPU_MARCH``
    set to another target, the flags of :data:`_MACRO_FLAGS` that the compiler defines for it (none where it
    cannot tell), so that an AVX2 build on an AVX-512 machine also takes the AVX2 machine's paths."""
    march = switches.current().cpu_march
    if march == "native":
        return frozenset(_cpu_signature().split())
    compiler = find_compiler()
    try:
        done = subprocess.run([compiler or "cc", f"-march={march}", "-dM", "-E", "-x", "c", "-"], input="",
                              capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return frozenset()
    defined = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return frozenset(flag for macro, flag in _MACRO_FLAGS.items() if macro in defined)


def build(compiler: str, out: Path, pycall: str | None = None) -> float:
    """Compile :data:`SOURCES` into the shared library ``out`` (written whole or not at all: a temporary file
    renamed into place), with OpenMP if the compiler has it, else without; with ``pycall`` (the C source of
    ``native_pycall.source``) also the extension module of direct Python entry points. Returns the seconds it
    took.

    Raises:
        NativeBuildError: neither build succeeded (the message holds the compiler's output).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    if pycall is None:
        return _build(compiler, out, [])
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        generated = Path(tmp) / "pycall.c"
        generated.write_text(pycall)
        return _build(compiler, out, [f"-I{native_pycall.python_include()}", str(generated)])


def _build(compiler: str, out: Path, extra_sources: list[str]) -> float:
    start, errors = time.perf_counter(), []
    for extra in (("-fopenmp",), ("-fopenmp-simd",)):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [compiler, *build_flags(), *extra, "-o", tmp, *map(str, SOURCES), *extra_sources]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            done, err = None, str(exc)
        if done is not None and done.returncode == 0:
            os.replace(tmp, out)
            return time.perf_counter() - start
        os.unlink(tmp)
        errors.append(f"$ {' '.join(cmd)}\n{done.stderr.strip() if done is not None else err}")
    raise NativeBuildError("compiling the CPU ops failed:\n" + "\n".join(errors))


class NativeOps(SimpleNamespace):
    """The C ops by name (``li_add_rms_norm``, ...): each the extension module's direct entry point where the
    library has one (``native_pycall.py``), else the ctypes function; the same arguments either way (ints for
    pointers, None for NULL). ``path``: the library; ``direct``: whether the direct entry points serve;
    ``replay``: the module's ``li_replay`` for :func:`pack_calls`' buffers (None without the module)."""


def library() -> NativeOps | None:
    """The loaded ops, built on the first call when no cached build fits; None when switched off
    (``LIGHTINFER_CPU_NATIVE=0``) or when they cannot be built or loaded (logged once, :data:`status`)."""
    global _lib, _tried, status
    if not switches.current().cpu_native:
        return None
    if _recording is not None and (rec := _active_recording()) is not None:
        return rec.ops
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _load()
        except (NativeBuildError, OSError) as exc:
            status = f"torch ops (the C ops are unavailable: {exc})"
            logger.warning("lightinfer: the CPU's small ops run as torch ops, slower at small batches: %s", exc)
        _tried = True
    return _lib


def _load() -> NativeOps:
    global status
    compiler = find_compiler()
    if compiler is None:
        raise NativeBuildError("no C compiler found (set $CC, or install gcc or clang)")
    pycall = native_pycall.source(_SIGNATURES) if native_pycall.python_include() is not None else None
    parts = [*(src.read_bytes() for src in SOURCES + HEADERS), compiler.encode(), " ".join(build_flags()).encode(),
             _cpu_signature().encode(), torch.__version__.encode()]
    path = cache_dir() / f"cpu_decode_ops-{_key(parts, pycall)}.so"
    if not path.exists():
        try:
            seconds = build(compiler, path, pycall)
        except NativeBuildError as exc:
            if pycall is None:
                raise
            logger.info("lightinfer: the C ops build without direct Python entry points: %s", exc)
            pycall, path = None, cache_dir() / f"cpu_decode_ops-{_key(parts, None)}.so"
            seconds = build(compiler, path) if not path.exists() else 0.0
        logger.info("lightinfer: compiled the CPU ops in %.1f s (%s)", seconds, path)
    lib = ctypes.CDLL(str(path))
    module = native_pycall.load(path) if pycall is not None else None
    ops = NativeOps(path=path, direct=module is not None)
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
        setattr(ops, name, getattr(module, name) if module is not None else fn)
    ops.replay = getattr(module, "li_replay", None)  # packed calls (pack_calls), where the module serves
    status = str(path)
    return ops


def _key(parts: list[bytes], pycall: str | None) -> str:
    """The build's cache key: the sources, compiler, flags, CPU, torch and (with it) the generated module."""
    return hashlib.sha256(b"\0".join([*parts, (pycall or "").encode()])).hexdigest()[:16]


def pack_calls(calls: list[tuple[str, tuple]]) -> torch.Tensor:
    """``(op name, arguments)`` calls packed for ``library().replay(packed.data_ptr(), len(calls))``, which makes
    them in order with the GIL released once (``native_pycall.pack_calls``): uint8."""
    return torch.frombuffer(native_pycall.pack_calls(_SIGNATURES, calls), dtype=torch.uint8)


def pointer_args(name: str) -> tuple[int, ...]:
    """The positions of the pointer arguments of the C op ``name`` (a key of :data:`_SIGNATURES`)."""
    return tuple(i for i, t in enumerate(_SIGNATURES[name]) if t is _P)


@contextlib.contextmanager
def recording(max_context: int) -> Iterator[Recording]:
    """Record the C ops this thread calls while inside (``engine/cpu_graph.py`` replays them).

    The ops run as usual and each call is appended to ``Recording.calls`` with its arguments. What would
    make a recorded call wrong to repeat on other inputs is changed for the recording: work buffers are
    fresh tensors (owned by the capture, not the per-thread scratch that a later call may grow and free),
    and decode attention sizes its buffer for ``max_context`` tokens, not for the longest context of the
    step; the range checks the replay skips report their limits in ``Recording.bounds``.

    Raises:
        RuntimeError: the C ops are unavailable, or another recording is under way.
    """
    global _recording
    lib = library()
    if lib is None:
        raise RuntimeError(f"the C ops are unavailable: {status}")
    with _lock:
        if _recording is not None:
            raise RuntimeError("a decode step is already being recorded")
        rec = _recording = Recording(lib, max_context)
    try:
        yield rec
    finally:
        _recording = None


def _active_recording() -> Recording | None:
    rec = _recording
    return rec if rec is not None and rec.thread == threading.get_ident() else None


def _usable(*tensors: torch.Tensor) -> bool:
    for t in tensors:  # a loop, not all(generator): called several times per layer, per step
        if not (t.is_cpu and t.is_contiguous()) or t.requires_grad:
            return False
    return True


def _checked_once(kind: str, keys: tuple[torch.Tensor, ...], extra: tuple, check: Callable[[], Any]) -> Any:
    """``check()`` once per step for these tensors and the sizes in ``extra`` it also depends on (the step
    memo of ``step_memo.py``)."""
    rec = _active_recording() if _recording is not None else None
    if rec is not None:
        with rec.checking():  # its torch ops are not part of the recorded step
            return step_memo.get(f"native:{kind}", keys, extra, check)
    return step_memo.get(f"native:{kind}", keys, extra, check)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x is None``: ``(rms_norm(residual) * weight, residual)``; else ``residual' = x + residual`` rounded to
    the dtype, ``(rms_norm(residual') * weight, residual')``. ``[..., hidden]`` fp32/bf16 (one dtype), weight
    ``[hidden]`` fp32/bf16. None where the C op does not apply."""
    lib = library()
    dt = _DTYPES.get(residual.dtype)
    wdt = _DTYPES.get(weight.dtype)
    if lib is None or dt is None or wdt is None or (x is not None and x.dtype != residual.dtype) or \
            not _usable(residual, weight, *(() if x is None else (x,))) or \
            (x is not None and x.shape != residual.shape) or weight.shape != residual.shape[-1:]:
        return None
    h = residual.shape[-1]
    out = torch.empty_like(residual)
    new_residual = residual if x is None else torch.empty_like(residual)
    lib.li_add_rms_norm(None if x is None else x.data_ptr(), residual.data_ptr(),
                        None if x is None else new_residual.data_ptr(), weight.data_ptr(), wdt, out.data_ptr(),
                        residual.numel() // max(h, 1), h, eps, dt, torch.get_num_threads())
    return out, new_residual


def qk_norm_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
             eps: float) -> bool:
    """In place: each q head and each k head of a fused projection's ``qkv [T, (H + 2 Hkv) * D]`` (fp32/bf16, rows
    contiguous) RMS-normalized with ``q_weight`` / ``k_weight`` ``[D]`` (fp32/bf16, one dtype), as
    :func:`add_rms_norm` normalizes a row. Returns False, untouched, where the C op does not apply."""
    lib = library()
    dt, wdt = _DTYPES.get(qkv.dtype), _DTYPES.get(q_weight.dtype)
    d = q_weight.shape[-1]
    if lib is None or dt is None or wdt is None or k_weight.dtype != q_weight.dtype or qkv.dim() != 2 or \
            qkv.stride(1) != 1 or not qkv.is_cpu or qkv.requires_grad or q_weight.shape != (d,) or \
            k_weight.shape != (d,) or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or \
            not _usable(q_weight, k_weight):
        return False
    lib.li_qk_norm(qkv.data_ptr(), dt, qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, d, q_weight.data_ptr(),
                   k_weight.data_ptr(), wdt, eps, torch.get_num_threads())
    return True


def silu_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``x [..., 2 I]`` -> ``silu(x[..., :I]) * x[..., I:]`` in fp32, rounded once; None where it does not apply."""
    lib = library()
    dt = _DTYPES.get(x.dtype)
    if lib is None or dt is None or not _usable(x) or x.shape[-1] % 2:
        return None
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    lib.li_silu_mul(x.data_ptr(), out.data_ptr(), x.numel() // max(2 * inter, 1), inter, dt, torch.get_num_threads())
    return out


# PagedKV id -> (the object, cache dtype code, pointers): a layer's cache tensors live as long as the engine
_kv_args: dict[int, tuple[PagedKV, int, tuple[int | None, ...]] | tuple[PagedKV, None, None]] = {}


def _cache_args(kv: PagedKV) -> tuple[int | None, tuple[int | None, ...] | None]:
    """``(cache dtype code, (k, v, k_scale, k_zero, v_scale, v_zero) pointers)``, or ``(None, None)`` for a
    layout the C ops do not read (strided, fp16). Worked out once per cache object."""
    hit = _kv_args.get(id(kv))
    if hit is not None and hit[0] is kv:
        return hit[1], hit[2]
    cdt = _I8 if kv.is_int8 else _DTYPES.get(kv.dtype)
    if cdt is None or not _usable(*kv.tensors()):
        entry: tuple = (kv, None, None)
    else:
        entry = (kv, cdt, tuple(t.data_ptr() if t is not None else None for t in (kv.k, kv.v, *kv.scales)))
    if len(_kv_args) > 4096:  # caches of engines that are gone
        _kv_args.clear()
    _kv_args[id(kv)] = entry
    return entry[1], entry[2]


_scratch = threading.local()


def _scratch_buffer(numel: int) -> torch.Tensor:
    """A per-thread fp32 work buffer of at least ``numel`` values, kept between calls (while recording a
    fresh one each call: see :func:`recording`)."""
    if _recording is not None and _active_recording() is not None:
        return torch.empty(max(numel, 1), dtype=torch.float32)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32)
    return buf


def rope_store(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
               cos_cache: torch.Tensor, sin_cache: torch.Tensor, kv: PagedKV,
               slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """``cpu_fused.rope_store_kvcache`` for whole-head rotation: q ``[T, H, D]`` returned, k and v stored.
    None where it does not apply (partial rotary, fp16, non-int64 positions or slots, a strided input)."""
    lib = library()
    dt = _DTYPES.get(qkv.dtype)
    d = kv.head_dim
    if lib is None or dt is None or qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.requires_grad or \
            qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or cos_cache.dtype != torch.float32 or \
            sin_cache.dtype != torch.float32 or cos_cache.shape[-1] * 2 != d or positions.dtype != torch.int64 or \
            slot_mapping.dtype != torch.int64 or not _usable(positions, slot_mapping, cos_cache, sin_cache):
        return None
    cdt, ptrs = _cache_args(kv)
    if cdt is None:
        return None
    t = qkv.shape[0]
    limit = kv.num_blocks * kv.block_size
    # the C op indexes the tables and the cache with these: out of range would be out of bounds
    if not _checked_once("rope", (positions, slot_mapping, cos_cache), (t, limit), lambda: t == 0 or (
            positions.shape == (t,) and slot_mapping.shape == (t,) and int(positions.min()) >= 0 and
            int(positions.max()) < cos_cache.shape[0] and int(slot_mapping.max()) < limit)):
        return None
    if _recording is not None and (rec := _active_recording()) is not None:
        rec.bound("positions", cos_cache.shape[0])
        rec.bound("slots", limit)
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype)
    lib.li_rope_store(qkv.data_ptr(), dt, t, qkv.stride(0), num_heads, num_kv_heads, d, positions.data_ptr(),
                      cos_cache.data_ptr(), sin_cache.data_ptr(), slot_mapping.data_ptr(), ptrs[0], ptrs[1], cdt,
                      *ptrs[2:], q.data_ptr(), torch.get_num_threads())
    return q


def attend_decode(q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float) -> torch.Tensor | None:
    """``torch_cpu.paged_attention_decode`` without a window or soft-cap: q ``[B, H, D]`` -> ``[B, H, D]``.
    None where it does not apply."""
    lib = library()
    dt = _DTYPES.get(q.dtype)
    if lib is None or dt is None or q.dim() != 3 or block_tables.dtype != torch.int32 or \
            context_lens.dtype != torch.int32 or not _usable(q, block_tables, context_lens):
        return None
    cdt, ptrs = _cache_args(kv)
    if cdt is None:
        return None
    b, h, d = q.shape
    hkv = kv.num_kv_heads
    if h % hkv or d != kv.head_dim:
        return None
    if b == 0:
        return torch.empty_like(q)

    def check() -> int:  # the longest context, or -1 when a table or length is out of range
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

    longest = _checked_once("attend", (block_tables, context_lens), (b, kv.block_size, kv.num_blocks), check)
    if longest < 0:
        return None
    if _recording is not None and (rec := _active_recording()) is not None:
        rec.bound("context", min(block_tables.shape[1] * kv.block_size, rec.max_context))
        rec.bound("blocks", kv.num_blocks)
        longest = max(longest, rec.max_context)  # the scratch holds any context a replay may have
    threads = torch.get_num_threads()
    g = h // hkv
    scratch = _scratch_buffer(threads * (g * longest + 2 * g * d))
    out = torch.empty_like(q)
    lib.li_attend_decode(q.data_ptr(), dt, b, h, hkv, d, scale, block_tables.data_ptr(), block_tables.shape[1],
                         context_lens.data_ptr(), kv.block_size, ptrs[0], ptrs[1], cdt, *ptrs[2:], out.data_ptr(),
                         scratch.data_ptr(), longest, threads)
    return out


W4_BLOCK = 32  # the activation block of the 4-bit product (int8, one scale per 32 values, as llama.cpp's Q8)
# From this many rows (a prefill) the weight is dequantized into a per-thread buffer and multiplied by torch's
# dense GEMM, where that was measured faster than the block dot products (bench/kernels/cpu_w4.py --gemm): to fp32 from
# 64 rows (exact), to bf16 from 24 rows on a CPU that multiplies bf16 in hardware (bf16_gemm_native: ~4x the
# fp32 GEMM, at 32 rows already 0.6-0.8x the block products' time on an AVX-512 EPYC, 2026-12-06).
W4_DENSE_ROWS = 64
W4_DENSE_ROWS_BF16 = 24
# With AMX (amx_available) a bf16 input takes li_w4_amx_linear from 5 rows: it dequantizes each weight once per
# call into cache-resident tiles, about the same work at 5 rows as at 32, while the block products' work grows
# with the rows (SmolLM2's 30 layers from memory, 2 threads, Sapphire Rapids Xeon 2026-12-06: 10.4 against 10.6
# ms at 4 rows, 9.9 against 12.9 at 5, 10.0 against 15.4 at 8).
W4_AMX_ROWS = 5
W4_DENSE_FLOATS = 1 << 22  # the buffer's size cap (16 MB): larger layers are dequantized in slices of rows
_dense = threading.local()


def w4_pack(codes: torch.Tensor) -> torch.Tensor | None:
    """uint8 codes ``[N, K]`` (0..15, one per byte) -> the 4-bit products' layout, uint8 ``[N, K / 2]``
    (``native/cpu_w4_layout.h``: blocks of 32 codes interleaved by 8, so that each int32 lane of a 32-byte
    vector holds 4 codes of one block). None without the C library or when K is not a multiple of 32."""
    lib = library()
    if lib is None or codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] % W4_BLOCK or \
            not _usable(codes):
        return None
    packed = torch.empty(codes.shape[0], codes.shape[1] // 2, dtype=torch.uint8)
    lib.li_w4_pack(codes.data_ptr(), packed.data_ptr(), codes.shape[0], codes.shape[1])
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
    xdt, ydt = _DTYPES.get(x.dtype), _DTYPES.get(out_dtype)
    if lib is None or xdt is None or ydt is None or x.dim() != 2 or not _usable(x) or \
            (bias is not None and (bias.dtype != torch.float32 or not _usable(bias))):
        return None
    m, k = x.shape
    n = packed.shape[0]
    if m >= dense_rows(x.dtype):
        return _w4_dense(lib, x, packed, dm, group_size, bias, out_dtype)
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    # the quantized input: int8 / int16 values (4-byte aligned), then fp32 block scales and block sums
    nb, size = k // W4_BLOCK, 1 if int8_activations else 2
    work = _scratch_buffer((m * k * size + 3) // 4 + 2 * m * nb)
    fn = lib.li_w4a8_linear if int8_activations else lib.li_w4a16_linear
    fn(x.data_ptr(), xdt, m, k, packed.data_ptr(), dm.data_ptr(), group_size, n,
       None if bias is None else bias.data_ptr(), y.data_ptr(), ydt, work.data_ptr(), torch.get_num_threads())
    return y


@functools.cache
def bf16_gemm_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 ``avx512_bf16`` or ``amx_bf16`` in :func:`cpu_flags`), where
    torch's bf16 GEMM (oneDNN) is measured ~4x its fp32 GEMM at a prefill's shapes (``bench/kernels/cpu_w4.py
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
    (_lib or lib).li_w4_amx_init(ok.data_ptr())  # the library's own op: never part of a recording
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
        n, threads = packed.shape[0], torch.get_num_threads()
        y = torch.empty(m, n, dtype=out_dtype)
        work = _scratch_buffer(((m + 15) // 16 * 16 + 32 * threads) * k // 2)  # 16-bit values: x in tiles, W's rows
        lib.li_w4_amx_linear(x.data_ptr(), m, k, packed.data_ptr(), dm.data_ptr(), group_size, n,
                             None if bias is None else bias.data_ptr(), y.data_ptr(), _DTYPES[out_dtype],
                             work.data_ptr(), threads)
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
        lib.li_w4_dequant(packed[n0:n1].data_ptr(), dm[n0:n1].data_ptr(), group_size, n1 - n0, k, w.data_ptr(),
                          _DTYPES[gemm], torch.get_num_threads())
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
    xdt, ydt = _DTYPES.get(x.dtype), _DTYPES.get(out_dtype)
    if lib is None or xdt is None or ydt is None or x.dim() != 2 or not _usable(x, qweight, scales) or \
            qweight.dtype != torch.int8 or scales.dtype != torch.bfloat16 or qweight.shape[1] % W4_BLOCK or \
            x.shape[1] != qweight.shape[1] or (bias is not None and (bias.dtype != torch.float32 or not _usable(bias))):
        return None
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    work = _scratch_buffer((m * k * 2 + 3) // 4 + m + 1)  # int16 values (4-byte aligned), then a scale per row
    lib.li_w8_linear(x.data_ptr(), xdt, m, k, qweight.data_ptr(), scales.data_ptr(), n,
                     None if bias is None else bias.data_ptr(), y.data_ptr(), ydt, work.data_ptr(),
                     torch.get_num_threads())
    return y



def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` for fp32 ``x [rows, n]`` (``native/cpu_sample.c``): the first index of each row's
    maximum, or of its first NaN, as torch's; int64 ``[rows]``. None where it does not apply (not fp32, not 2-D
    and contiguous, no C library)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or not _usable(x) or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.li_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out
