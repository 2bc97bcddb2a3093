"""Programmatic dependent launch (PDL): let a kernel start before the one ahead of it in the stream ends.

A decode step at batch 1 is ~10 kernels per layer, each a few µs; between two dependent kernels the GPU
sits idle while the first drains, flushes its writes and the second is launched and set up. With PDL
(sm_90 and later: ``griddepcontrol`` in PTX, the ``launch_pdl`` launch option of Triton >= 3.3; CUDA
graph capture keeps these edges) a kernel's programs are started early and wait in hardware until the
previous kernel has finished and its memory is visible, so that gap shrinks to the wait itself.

Every kernel of ours calls :func:`pdl_start` before it touches memory and passes ``**pdl_launch(device)``
to its launch: each program first lets the *next* kernel's programs launch, then waits for the *previous*
kernel to complete. Nothing is read or written before that wait, so reuse of a freed buffer by the
caching allocator, reads of outputs two kernels back (each kernel completes only after the one before it)
and kernels of other libraries in between (launched without PDL: ordinary stream order) all stay as safe
as without it. ``LIGHTINFER_PDL=0`` turns it off (``switches.py``); it is off on older GPUs, older drivers
(graph capture of these launches needs CUDA 12.3) and on the CPU interpreter. The W4 GEMMs prefetch the
first K steps of their weights into L2 before the wait (``LIGHTINFER_PDL_PREFETCH=0`` turns that alone off).
``python -m lightinfer.kernels.audit.pdl_check`` checks in the compiled SASS that every kernel waits before
it touches memory.

Source: CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA,
``griddepcontrol``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import triton
import triton.language as tl

from . import switches
from .launch_utils import interpreting


@triton.jit
def pdl_start(USE_PDL: tl.constexpr = False):
    """First thing in a kernel: release the next kernel's launch, then wait for the previous kernel's
    completion and memory (no-ops when the kernel was launched without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 to fetch the 128-byte lines holding ``ptrs`` (a tensor of global addresses; no registers, no
    wait). Only for memory no kernel writes (weights): it may run before :func:`pdl_start`'s wait."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def driver_version() -> int | None:
    """The CUDA driver's version (``cuDriverGetVersion``: 12030 for 12.3), or None where libcuda cannot be
    asked."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        name = ctypes.util.find_library("cuda")
        if name is None:
            return None
        lib = ctypes.CDLL(name)
    version = ctypes.c_int(0)
    return int(version.value) if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


# Stream capture turns PDL launches into programmatic graph edges from CUDA 12.3 (the decode steps are graphs).
MIN_DRIVER = 12030


@functools.cache
def _supported(index: int) -> bool:
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:  # a Triton build without the CUDA extras
        return False
    if torch.cuda.get_device_capability(index)[0] < 9 or not hasattr(tl_cuda, "gdc_wait"):
        return False
    version = driver_version()
    return version is not None and version >= MIN_DRIVER


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA GPU of compute capability 9.0 or later, a driver
    of CUDA 12.3 or later, Triton with ``griddepcontrol`` support, not the interpreter, and ``LIGHTINFER_PDL``
    not ``0``."""
    if device.type != "cuda" or interpreting() or not switches.current().pdl:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def prefetch_enabled(device: torch.device) -> bool:
    """Whether the W4 GEMMs prefetch the first K steps of their weights into L2 before the wait: with PDL on,
    unless ``LIGHTINFER_PDL_PREFETCH=0`` (so one GPU run can time PDL with and without it)."""
    return pdl_launch(device, prefetch=True)["PREFETCH"]


def pdl_launch(device: torch.device, prefetch: bool = False) -> dict[str, Any]:
    """Keyword arguments for a kernel launch on ``device``: the kernel's ``USE_PDL`` constexpr, and the
    ``launch_pdl`` launch option when PDL is on; with ``prefetch`` (the W4 GEMMs) also their ``PREFETCH``
    constexpr (:func:`prefetch_enabled`), from the same decision."""
    on = pdl_enabled(device)
    kwargs: dict[str, Any] = {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
    if prefetch:
        kwargs["PREFETCH"] = on and switches.current().pdl_prefetch
    return kwargs
