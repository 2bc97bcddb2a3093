"""Compile every kernel configuration for a consumer-card target and report its shared memory,
registers and register spills.

Consumer GPUs have far less shared memory per block than datacenter ones (opt-in maximum:
sm_80 163 KB, sm_86/sm_89 99 KB, sm_90 227 KB); a configuration tuned on an H100/H200 can
fail to launch on an RTX card. Triton compiles for a target it is not running on
(``triton.compile(ASTSource(...), target=GPUTarget("cuda", 86, 32))``): no GPU or driver is
needed, ``ptxas`` ships inside the triton wheel, and ``metadata.shared`` holds the bytes. A
configuration that fits can still run out of registers (255 per thread): ptxas then spills to
local memory (``STL``/``LDL`` through L1), which this reports too.

The specs come from ``specs.all_launch_specs()``, which enumerates exactly the configurations the
launchers can pick, from their own configuration tables. Usage::

    python -m lightinfer.kernels.audit.smem_check [--arch 86] [--json]

Must run with ``TRITON_INTERPRET`` unset: under the interpreter ``@triton.jit`` yields
interpreter objects that cannot be compiled (the test runs this module in a subprocess).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import sys
from typing import Any

from .compile import compile_spec, json_constexprs, registers
from .specs import all_launch_specs

# Opt-in maximum dynamic shared memory per block, bytes (CUDA programming guide, table 21).
SMEM_LIMIT_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def compile_stats(spec: Any, arch: int) -> dict[str, int]:
    """Compile ``spec`` for ``cuda:sm_<arch>``: shared memory (``metadata.shared``, bytes), registers
    per thread and register-spill stores (``STL`` instructions in the SASS; any is a config to shrink).

    Compiled as Triton specialises at run time for the Llama shapes (:func:`.compile.compile_spec`):
    unspecialised variants (odd strides) use more registers.

    Raises:
        RuntimeError: when run under ``TRITON_INTERPRET=1``.
    """
    from triton.tools.disasm import get_sass

    compiled = compile_spec(spec, arch)
    sass = get_sass(compiled.asm["cubin"])
    return {"shared": int(compiled.metadata.shared), "registers": registers(compiled.asm["cubin"]),
            "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\s", sass))}


def _compile_indices(arch: int, indices: list[int]) -> list[dict[str, int]]:
    """Worker: :func:`compile_stats` of ``all_launch_specs()[i]`` for each ``i`` (specs hold kernels: not picklable)."""
    specs = all_launch_specs()
    return [compile_stats(specs[i], arch) for i in indices]


def check(arch: int = 86, jobs: int | None = None) -> list[dict[str, Any]]:
    """Compile all specs for ``arch`` (``jobs`` processes; default one per CPU) -> rows with ``shared``, ``fits``,
    ``registers`` and ``spill_stores``."""
    limit = SMEM_LIMIT_BYTES[arch]
    specs = all_launch_specs()
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    if jobs == 1:
        stats = _compile_indices(arch, list(range(len(specs))))
    else:
        # Compilation is CPU-bound Python + ptxas: one process per core roughly divides the time.
        chunks = [list(range(j, len(specs), jobs)) for j in range(jobs)]
        stats = [{}] * len(specs)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            for chunk, result in zip(chunks, pool.map(_compile_indices, [arch] * jobs, chunks)):
                for i, b in zip(chunk, result):
                    stats[i] = b
    rows = []
    for spec, st in zip(specs, stats):
        rows.append({
            "name": spec.name,
            "constexprs": json_constexprs(spec),
            "num_warps": spec.num_warps,
            "num_stages": spec.num_stages,
            **st,
            "limit": limit,
            "fits": st["shared"] <= limit,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI: print one line per configuration; exit 1 if any does not fit or spills registers."""
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
            flag = ("ok " if r["fits"] else "TOO BIG") + (f" SPILLS({r['spill_stores']})" if r["spill_stores"] else "")
            print(f"{flag} {r['shared']:>7} B {r['registers']:>4} regs  {r['name']:<28} w={r['num_warps']} "
                  f"s={r['num_stages']} {ce}")
        print(f"{sum(r['fits'] for r in rows)}/{len(rows)} configurations fit sm_{args.arch} "
              f"({SMEM_LIMIT_BYTES[args.arch]} bytes); {sum(r['spill_stores'] > 0 for r in rows)} spill registers")
    return 0 if all(r["fits"] and not r["spill_stores"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
