"""Building the CPU's C ops (``native/*.c``): compiler discovery, flags, the build and its cache.

The library is built once per source, compiler, flags, CPU and torch version with the system's C compiler
(``$CC``, else ``cc`` / ``gcc`` / ``clang``: ``-O3 -march=native``, OpenMP when available, about a second)
into ``$XDG_CACHE_HOME/lightinfer/native`` (``~/.cache``). Where the Python headers are installed the same
shared library also holds the CPython extension module that ``native_pycall.py`` generates from the ABI table
(``native_abi.py``). :func:`compile_cached` returns the built file; ``cpu_native.py`` loads and binds it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from . import native_pycall, switches

logger = logging.getLogger("lightinfer")

NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCES = tuple(NATIVE_DIR / name for name in ("cpu_decode_ops.c", "cpu_w4_pack.c", "cpu_w4a16.c", "cpu_w4a8.c",
                                                "cpu_w8.c", "cpu_sample.c", "cpu_w4_amx.c"))
# included by the sources: part of the build's cache key
HEADERS = (NATIVE_DIR / "cpu_convert.h", NATIVE_DIR / "cpu_w4_layout.h", NATIVE_DIR / "cpu_w4_dequant.h",
           NATIVE_DIR / "cpu_kv_cache.h")
# -mprefer-vector-width=512: gcc's -march=native vectorises loops in 256-bit registers on Intel CPUs with
# AVX-512, and the C ops' plain loops (norms, SiLU, decode attention) gain from 512-bit ones
# (docs/cpu_performance.md, "Measurements behind the C ops' choices"). CPUs without AVX-512 ignore it.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fno-strict-aliasing",
         "-shared", "-fPIC", *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64")
                               else ()))


class NativeBuildError(RuntimeError):
    """The C compiler failed, or there is none; the message holds its command and output."""


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


def cpu_signature() -> str:
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
        return frozenset(cpu_signature().split())
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


def _key(parts: list[bytes], pycall: str | None) -> str:
    """The build's cache key: the sources, compiler, flags, CPU, torch and (with it) the generated module."""
    return hashlib.sha256(b"\0".join([*parts, (pycall or "").encode()])).hexdigest()[:16]


def compile_cached(compiler: str | None, pycall: str | None) -> tuple[Path, bool]:
    """The library for this machine: the cached build where one fits, else built now (logged).

    Args:
        compiler: the C compiler (:func:`find_compiler`); None raises.
        pycall: the extension module's C source (``native_pycall.source``), or None to build without it.
    Returns:
        ``(path, with_module)``: the shared library, and whether it holds the extension module (a build with
        it that fails is retried without it, logged).
    Raises:
        NativeBuildError: no compiler, or the build failed.
    """
    if compiler is None:
        raise NativeBuildError("no C compiler found (set $CC, or install gcc or clang)")
    parts = [*(src.read_bytes() for src in SOURCES + HEADERS), compiler.encode(), " ".join(build_flags()).encode(),
             cpu_signature().encode(), torch.__version__.encode()]
    path = cache_dir() / f"cpu_decode_ops-{_key(parts, pycall)}.so"
    if path.exists():
        return path, pycall is not None
    try:
        seconds = build(compiler, path, pycall)
    except NativeBuildError as exc:
        if pycall is None:
            raise
        logger.info("lightinfer: the C ops build without direct Python entry points: %s", exc)
        pycall, path = None, cache_dir() / f"cpu_decode_ops-{_key(parts, None)}.so"
        seconds = build(compiler, path) if not path.exists() else 0.0
    logger.info("lightinfer: compiled the CPU ops in %.1f s (%s)", seconds, path)
    return path, pycall is not None
