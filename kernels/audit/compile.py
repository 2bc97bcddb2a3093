"""Compiling a :class:`~.specs.LaunchSpec` for a GPU target without a GPU, and reading the result.

Triton compiles for a target it is not running on (``triton.compile(ASTSource(...), target=GPUTarget(...))``);
``ptxas``, ``cuobjdump`` and ``nvdisasm`` ship inside the triton wheel. Must run with ``TRITON_INTERPRET``
unset: under the interpreter ``@triton.jit`` yields objects that cannot be compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

from ..launch_utils import COMPILE_OPTIONS

# Integer arguments that are multiples of 16 at the Llama shapes (Triton marks those divisible).
_DIVISIBLE_INTS = re.compile(r"^(stride_\w+|N|K|head_dim|partition_size|block_size)$")


def compile_spec(spec: Any, arch: int, one: tuple[str, ...] = ()) -> Any:
    """Compile ``spec`` for ``sm_<arch>`` with run-time-like specialisation; ``one`` names ints equal to 1.

    Raises:
        RuntimeError: when run under ``TRITON_INTERPRET=1``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(spec.kernel, JITFunction):
        raise RuntimeError("compiling kernels needs TRITON_INTERPRET unset (kernels are interpreter objects)")  # noqa: TRY004
    signature, constexprs = dict(spec.signature), dict(spec.constexprs)
    for p in spec.kernel.params:  # constexprs a spec leaves out (e.g. USE_PDL) take their defaults
        if p.name not in signature and p.is_constexpr and p.has_default:
            signature[p.name], constexprs[p.name] = "constexpr", p.default
    for name in one:
        signature[name], constexprs[name] = "constexpr", 1
    attrs = {}
    for i, name in enumerate(spec.kernel.arg_names):
        kind = signature.get(name, "constexpr")
        if kind.startswith("*") or (kind == "i32" and _DIVISIBLE_INTS.match(name)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=spec.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": spec.num_warps, "num_stages": spec.num_stages, **COMPILE_OPTIONS})


def json_constexprs(spec: Any) -> dict[str, Any]:
    """``spec``'s constexprs for a JSON row (values that are not plain numbers or strings as text)."""
    return {k: (v if isinstance(v, (int, float, bool, str)) else str(v)) for k, v in spec.constexprs.items()}


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def registers(cubin: bytes) -> int:
    """Registers per thread of the kernel in ``cubin`` (``cuobjdump -res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    match = re.search(r"REG:(\d+)", out)
    return int(match.group(1)) if match else -1
