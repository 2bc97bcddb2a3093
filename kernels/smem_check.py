"""Compile every kernel configuration for a consumer-card target and report its shared memory.

Consumer GPUs have far less shared memory per block than datacenter ones (opt-in maximum:
sm_80 163 KB, sm_86/sm_89 99 KB, sm_90 227 KB); a configuration tuned on an H100/H200 can
fail to launch on an RTX card. Triton compiles for a target it is not running on
(``triton.compile(ASTSource(...), target=GPUTarget("cuda", 86, 32))``): no GPU or driver is
needed, ``ptxas`` ships inside the triton wheel, and ``metadata.shared`` holds the bytes.

The specs come from each launcher module's ``launch_specs()``, which enumerates exactly the
configurations that launcher can pick. Usage::

    python -m lightinfer.kernels.smem_check [--arch 86] [--json]

Must run with ``TRITON_INTERPRET`` unset: under the interpreter ``@triton.jit`` yields
interpreter objects that cannot be compiled (the test runs this module in a subprocess).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
from typing import Any

# Opt-in maximum dynamic shared memory per block, bytes (CUDA programming guide, table 21).
SMEM_LIMIT_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def all_launch_specs() -> list[Any]:
    """Every :class:`LaunchSpec` of every launcher in this package."""
    from . import kv_store, norm_rope, paged_attention, w4a16_gemm

    specs: list[Any] = []
    for mod in (w4a16_gemm, paged_attention, kv_store, norm_rope):
        specs.extend(mod.launch_specs())
    return specs


def compile_shared_bytes(spec: Any, arch: int) -> int:
    """Compile ``spec`` for ``cuda:sm_<arch>`` and return ``metadata.shared`` (bytes).

    Raises:
        RuntimeError: when run under ``TRITON_INTERPRET=1``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(spec.kernel, JITFunction):
        raise RuntimeError("smem_check needs TRITON_INTERPRET unset (kernels are interpreter objects)")  # noqa: TRY004
    src = ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    return int(compiled.metadata.shared)


def _compile_indices(arch: int, indices: list[int]) -> list[int]:
    """Worker: shared bytes of ``all_launch_specs()[i]`` for each ``i`` (specs hold kernels: not picklable)."""
    specs = all_launch_specs()
    return [compile_shared_bytes(specs[i], arch) for i in indices]


def check(arch: int = 86, jobs: int | None = None) -> list[dict[str, Any]]:
    """Compile all specs for ``arch`` (``jobs`` processes; default one per CPU) -> rows with ``shared``, ``fits``."""
    limit = SMEM_LIMIT_BYTES[arch]
    specs = all_launch_specs()
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    if jobs == 1:
        shared_bytes = _compile_indices(arch, list(range(len(specs))))
    else:
        # Compilation is CPU-bound Python + ptxas: one process per core roughly divides the time.
        chunks = [list(range(j, len(specs), jobs)) for j in range(jobs)]
        shared_bytes = [0] * len(specs)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            for chunk, result in zip(chunks, pool.map(_compile_indices, [arch] * jobs, chunks)):
                for i, b in zip(chunk, result):
                    shared_bytes[i] = b
    rows = []
    for spec, shared in zip(specs, shared_bytes):
        rows.append({
            "name": spec.name,
            "constexprs": {k: (v if isinstance(v, (int, float, bool, str)) else str(v))
                           for k, v in spec.constexprs.items()},
            "num_warps": spec.num_warps,
            "num_stages": spec.num_stages,
            "shared": shared,
            "limit": limit,
            "fits": shared <= limit,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI: print one line per configuration; exit 1 if any does not fit."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=86, choices=sorted(SMEM_LIMIT_BYTES))
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU)")
    args = p.parse_args(argv)
    rows = check(args.arch, args.jobs)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            ce = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
            flag = "ok " if r["fits"] else "TOO BIG"
            print(f"{flag} {r['shared']:>7} B  {r['name']:<28} w={r['num_warps']} s={r['num_stages']} {ce}")
        print(f"{sum(r['fits'] for r in rows)}/{len(rows)} configurations fit sm_{args.arch} "
              f"({SMEM_LIMIT_BYTES[args.arch]} bytes)")
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
