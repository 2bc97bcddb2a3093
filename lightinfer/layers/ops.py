"""Backend dispatch: which op backend (``lightinfer.kernels.backends``) runs the ops on a tensor.

Layers call ``ops_for(x).<name>(...)``; the three backends expose the same functions with the same
signatures (``kernels.OP_NAMES``):

* ``triton``: the Triton launchers, for CUDA tensors;
* ``torch_cpu``: fast PyTorch, for everything else (the CPU engine);
* ``reference``: the naive oracle, only when forced.

Forcing: ``LIGHTINFER_BACKEND=<name>`` (read once, ``kernels/switches.py``) for a whole process, or
:func:`use_backend` / :func:`triton_on_cpu` for a block of code (tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch

from lightinfer.kernels import BACKEND_NAMES, get_backend, switches

_forced: str | None = None  # set by use_backend()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Inside this block every tensor's ops run on backend ``name`` (``triton``, ``torch_cpu`` or
    ``reference``), whatever its device and ``LIGHTINFER_BACKEND``. Not thread-safe (a module flag).

    Raises:
        ValueError: ``name`` is not a backend.
    """
    global _forced
    if name not in BACKEND_NAMES:
        raise ValueError(f"no kernel backend {name!r}; the backends are {', '.join(BACKEND_NAMES)}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def triton_on_cpu() -> contextlib.AbstractContextManager[None]:
    """Inside this block CPU tensors take the Triton kernels too, which then run on Triton's CPU
    interpreter (``TRITON_INTERPRET=1`` must be set): the GPU code path of a whole model, end to
    end, on a machine without a GPU. For tests; slow. ``use_backend("triton")``."""
    return use_backend("triton")


def backend_name(x: torch.Tensor) -> str:
    """The backend that runs ops on ``x``: a forced one (:func:`use_backend`, then ``LIGHTINFER_BACKEND``),
    else ``triton`` on CUDA and ``torch_cpu`` elsewhere.

    Raises:
        ValueError: ``LIGHTINFER_BACKEND`` names no backend.
    """
    forced = _forced or switches.current().backend
    if forced is not None:
        return forced
    return "triton" if x.is_cuda else "torch_cpu"


def uses_triton(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` run the Triton kernels (:func:`backend_name` is ``triton``)."""
    return backend_name(x) == "triton"


def ops_for(x: torch.Tensor) -> ModuleType:
    """The backend module for ``x`` (:func:`backend_name`)."""
    return get_backend(backend_name(x))
