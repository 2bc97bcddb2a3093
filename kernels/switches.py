"""The kernel switches: every ``LIGHTINFER_*`` environment variable the kernels and backends obey, read once.

=============================  ==================================================================
``LIGHTINFER_BACKEND``         force one op backend for every tensor: ``triton``, ``torch_cpu`` or
                               ``reference`` (unset: Triton on CUDA, ``torch_cpu`` elsewhere;
                               ``lightinfer.layers.ops`` decides)
``LIGHTINFER_F16_DECODE=0``    tensor-core and dequant W4 kernels decode fp16 weights in fp32
                               (to compare the two decodes on a GPU)
``LIGHTINFER_PDL=0``           no programmatic dependent launch (``pdl.py``)
``LIGHTINFER_PDL_PREFETCH=0``  PDL without the W4 GEMMs' L2 prefetch of their first weights
``LIGHTINFER_W4A16_CONFIGS``   a tuned-config file used whatever the GPU, or ``none`` for the
                               built-in launches everywhere (``w4a16_tuning.py``)
``LIGHTINFER_CPU_LOWBIT=0``    on a CPU, 4-/8-bit layers are dequantized once into dense weights
                               instead of staying low-bit for torch's int4 GEMM (``cpu_lowbit.py``):
                               the exact path, 4-8x the memory
``LIGHTINFER_CPU_NATIVE=0``    on a CPU, norms, RoPE + KV store, decode attention and SiLU·mul run
                               as torch ops instead of the C ops compiled at first use
                               (``cpu_native.py``), and 4-bit layers use torch's int4 GEMM
``LIGHTINFER_CPU_W4``          on a CPU, the product of 4-bit layers (``cpu_lowbit.py``): ``c``
                               (default: the C product, activations int16 per block of 32), ``int8``
                               (the same with activations int8 per block of 32) or ``torch``
                               (torch's int4 GEMM, bf16 activations; also torch's int8 GEMM for an
                               8-bit LM head, which the C product takes otherwise)
``LIGHTINFER_CPU_AMX=0``       on a CPU with AMX, 4-bit products of 5 rows or more (prefills, decode
                               batches) run as without AMX instead of on its tiles: the block
                               products below 24 rows, the weight dequantized for torch's bf16 GEMM
                               from 24 (``cpu_native.w4_linear``)
``LIGHTINFER_CPU_MARCH``       the ``-march`` the CPU's C ops are built for (default ``native``),
                               e.g. ``haswell`` for an AVX2-only build on a newer CPU; the paths
                               that need bf16 or AMX instructions then follow what that target has,
                               not this CPU (``cpu_native.cpu_flags``)
=============================  ==================================================================

The environment is read at the first :func:`current` call and never again: a launch costs a dict
lookup, not an ``os.environ`` read per switch. :func:`reload` re-reads it (a test or benchmark that
changes a variable in-process); :func:`override` sets switches for a ``with`` block without touching
the environment (benchmarks comparing settings in one run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

BACKEND_ENV = "LIGHTINFER_BACKEND"
F16_DECODE_ENV = "LIGHTINFER_F16_DECODE"
PDL_ENV = "LIGHTINFER_PDL"
PDL_PREFETCH_ENV = "LIGHTINFER_PDL_PREFETCH"
W4A16_CONFIGS_ENV = "LIGHTINFER_W4A16_CONFIGS"
CPU_LOWBIT_ENV = "LIGHTINFER_CPU_LOWBIT"
CPU_NATIVE_ENV = "LIGHTINFER_CPU_NATIVE"
CPU_W4_ENV = "LIGHTINFER_CPU_W4"
CPU_AMX_ENV = "LIGHTINFER_CPU_AMX"
CPU_MARCH_ENV = "LIGHTINFER_CPU_MARCH"
BACKEND_NAMES = ("triton", "torch_cpu", "reference")
CPU_W4_NAMES = ("c", "int8", "torch")


@dataclass(frozen=True)
class KernelSwitches:
    """One reading of the switches (module docstring).

    Attributes:
        backend: the forced op backend (one of :data:`BACKEND_NAMES`), or None to choose by device.
        f16_decode: fp16 activations take the fp16-pair weight decode (``w4a16_gemm.f16_decode``).
        pdl: programmatic dependent launch where the GPU and driver support it (``pdl.pdl_enabled``).
        pdl_prefetch: with PDL on, the W4 GEMMs prefetch their first weights into L2 before the wait.
        w4a16_configs: a tuned-config file path, ``"none"``, or None (the GPU model's own file).
        cpu_lowbit: on a CPU, 4-/8-bit layers with 16-bit activations stay low-bit (``cpu_lowbit.py``).
        cpu_native: on a CPU, the per-layer small ops use the C ops of ``cpu_native.py`` where they apply.
        cpu_w4: on a CPU, the product of 4-bit layers (``cpu_lowbit.py``): ``"c"`` (the C product of
            ``cpu_native``, activations int16 per block of 32), ``"int8"`` (the same, activations int8)
            or ``"torch"`` (torch's int4 GEMM, bf16 activations; also where the C library does not build).
            ``"torch"`` also keeps torch's int8 GEMM for an 8-bit LM head (else ``cpu_native.w8_linear``).
        cpu_amx: on a CPU with AMX, a 4-bit product of many rows runs on the tiles (``cpu_w4_amx.c``).
        cpu_march: the ``-march`` target of the C ops (``"native"``: this CPU).
    """

    backend: str | None = None
    f16_decode: bool = True
    pdl: bool = True
    pdl_prefetch: bool = True
    w4a16_configs: str | None = None
    cpu_lowbit: bool = True
    cpu_native: bool = True
    cpu_w4: str = "c"
    cpu_amx: bool = True
    cpu_march: str = "native"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelSwitches:
        """Read the switches from ``environ``; a variable other than ``"0"`` leaves a flag on.

        Raises:
            ValueError: ``LIGHTINFER_BACKEND`` names no backend, ``LIGHTINFER_CPU_W4`` no CPU product, or
                ``LIGHTINFER_CPU_MARCH`` is not a target's name.
        """
        backend = environ.get(BACKEND_ENV) or None
        if backend is not None and backend not in BACKEND_NAMES:
            raise ValueError(f"{BACKEND_ENV}={backend!r} is not a backend; use one of {', '.join(BACKEND_NAMES)} "
                             f"or unset it (Triton on CUDA, torch_cpu elsewhere)")
        cpu_w4 = environ.get(CPU_W4_ENV) or "c"
        if cpu_w4 not in CPU_W4_NAMES:
            raise ValueError(f"{CPU_W4_ENV}={cpu_w4!r} is not a CPU 4-bit product; use one of "
                             f"{', '.join(CPU_W4_NAMES)} or unset it (c)")
        return cls(backend=backend,
                   f16_decode=environ.get(F16_DECODE_ENV, "1") != "0",
                   pdl=environ.get(PDL_ENV, "1") != "0",
                   pdl_prefetch=environ.get(PDL_PREFETCH_ENV, "1") != "0",
                   w4a16_configs=environ.get(W4A16_CONFIGS_ENV) or None,
                   cpu_lowbit=environ.get(CPU_LOWBIT_ENV, "1") != "0",
                   cpu_native=environ.get(CPU_NATIVE_ENV, "1") != "0",
                   cpu_w4=cpu_w4,
                   cpu_amx=environ.get(CPU_AMX_ENV, "1") != "0",
                   cpu_march=_march(environ.get(CPU_MARCH_ENV) or "native"))


def _march(value: str) -> str:
    """``LIGHTINFER_CPU_MARCH`` checked: it reaches a compiler's command line, so only a target's name."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", value):
        raise ValueError(f"{CPU_MARCH_ENV}={value!r} is not a -march target; use a name such as haswell, "
                         f"icelake-server, x86-64-v3, or unset it (native)")
    return value


_current: KernelSwitches | None = None


def current() -> KernelSwitches:
    """The switches in force: the environment as first read (see :func:`reload`, :func:`override`).

    Raises:
        ValueError: from :meth:`KernelSwitches.from_env` on a bad ``LIGHTINFER_BACKEND``.
    """
    global _current
    if _current is None:
        _current = KernelSwitches.from_env()
    return _current


def reload() -> KernelSwitches:
    """Read the environment again (after a test or benchmark changed it) and return the new switches."""
    global _current
    _current = None
    return current()


@contextlib.contextmanager
def override(**changes: object) -> Iterator[KernelSwitches]:
    """Inside the block the switches are :func:`current`'s with ``changes`` (field names of
    :class:`KernelSwitches`); afterwards the previous ones. Not thread-safe (one module-level value).

    Raises:
        TypeError: a name that is not a switch.
        ValueError: a backend that is not one of :data:`BACKEND_NAMES`.
    """
    global _current
    previous = current()
    if changes.get("backend") not in (None, *BACKEND_NAMES):
        raise ValueError(f"backend {changes['backend']!r} is not one of {', '.join(BACKEND_NAMES)}")
    _current = dataclasses.replace(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous
