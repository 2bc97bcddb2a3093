"""lightinfer: quantization-first LLM inference (AWQ W4A16 weights, INT8 paged KV cache).

Public names: :class:`LLM`, :class:`SamplingParams`, :class:`StructuredOutputs`, :func:`pipeline`,
:func:`quantize`, :func:`fit`.
"""

from __future__ import annotations

import os as _os

# In a source checkout the layers live in sibling folders (kernels/, models/, quant/, webui/) that
# pyproject's package-dir maps to lightinfer.kernels etc. An install that ignores package-dir (a
# legacy `setup.py develop`, or running from the checkout with nothing installed) would not find
# them; adding the checkout root to this package's path does.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "reference.py")
):
    __path__.append(_root)  # type: ignore[name-defined]


def _import_hub_kernels_first() -> None:
    """Import the installed ``kernels`` distribution (Hugging Face's, which transformers imports) before the
    checkout's own ``kernels/`` folder can shadow it.

    Whenever the checkout root is on ``sys.path`` (pytest with ``tests`` as a package, ``python -m`` or
    ``python -c`` from the checkout), ``import kernels`` would find the folder, and transformers (>= 5 needs
    the distribution) would fail to read any config with "cannot import name 'CUDAProperties' from 'kernels'";
    a script run from inside ``bench/`` finds the ``bench/kernels/`` package first, the same failure. Imported once
    with every folder of the checkout out of the path, the distribution is what ``sys.modules`` then serves.
    """
    import importlib
    import importlib.util
    import sys

    env = _os.path.abspath(sys.prefix) + _os.sep  # a virtual environment may live in the checkout (.venv)

    def is_root(entry: str) -> bool:  # the checkout or a folder of it, not the environment's site-packages
        path = _os.path.abspath(entry or _os.curdir)
        # isdir: an editable install's path-hook marker ("__editable__....__path_hook__") is no folder, though
        # abspath would place it in the current directory
        return ((path == _root or path.startswith(_root + _os.sep)) and not path.startswith(env)
                and _os.path.isdir(path))

    if "kernels" in sys.modules or not any(is_root(p) for p in sys.path):
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if not is_root(p)]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    except Exception:  # noqa: BLE001, S110 -- a broken distribution: transformers reports it when it needs it
        pass
    finally:
        sys.path[:] = saved


if __path__[-1] == _root:  # type: ignore[name-defined]  # a source checkout
    _import_hub_kernels_first()

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightinfer.llm import LLM, pipeline
    from lightinfer.outputs import CompletionOutput, RequestOutput
    from lightinfer.sampling_params import SamplingParams
    from lightinfer.structured import StructuredOutputs

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputs", "fit", "pipeline",
           "quantize"]
__version__ = "0.1.0"

# The public names are imported on first use (PEP 562): `import lightinfer` alone, as `lightinfer --help`
# and `--version` do, then costs no torch/transformers import (seconds).
_LAZY = {"LLM": "lightinfer.llm", "pipeline": "lightinfer.llm", "CompletionOutput": "lightinfer.outputs",
         "RequestOutput": "lightinfer.outputs", "SamplingParams": "lightinfer.sampling_params",
         "StructuredOutputs": "lightinfer.structured"}


def __getattr__(name: str) -> object:
    """``lightinfer.LLM`` etc.: import the defining module on first access (then cached as a global)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightinfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def quantize(src: str, out: str, config: object = None, **kwargs: object) -> object:
    """Quantize ``src`` into an AWQ checkpoint at ``out``.

    See :func:`lightinfer.quant.api.quantize` (``config`` is a ``QuantConfig``; keyword options
    ``force`` and ``progress``). Returns its ``QuantSummary``.
    """
    from lightinfer.quant.api import quantize as _quantize

    return _quantize(src, out, config, **kwargs)


def fit(model: str, vram: object = ("8GiB", "12GiB", "24GiB"), **kwargs: object) -> object:
    """Will ``model`` fit GPUs of these sizes? From its config and tensor headers only (nothing is loaded).

    See :func:`lightinfer.engine.fit.fit` (keyword options ``max_model_len``, ``kv_cache_dtype``,
    ``gpu_memory_utilization``...). Returns its ``FitReport`` (``.rows``, ``.table()``, ``.to_dict()``).
    """
    from lightinfer.engine.fit import fit as _fit

    return _fit(model, vram, **kwargs)
