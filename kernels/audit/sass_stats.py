"""Static instruction counts of the hot loops of the decode-path kernels, per weight or per cache byte.

Decode is memory-bound only while a kernel issues few enough instructions per byte it reads. An
H200 SM moves ~16 bytes per cycle at the copy bandwidth and issues at most 4 warp instructions
(128 thread instructions) per cycle, so a kernel whose loop needs more than ~8 thread
instructions per byte (~4 per 4-bit weight) cannot reach the bandwidth whatever its memory
access pattern. This script compiles the launchers' own configurations for an sm_90 (or sm_86)
target without a GPU (``ptxas``, ``cuobjdump`` and ``nvdisasm`` ship in the triton wheel), finds
the kernel's innermost hot loop in the SASS (the longest backward branch) and counts its
instructions by opcode. Counts are static: they say how much work one loop iteration is, not how
long it takes (latency, occupancy and memory stalls need a GPU: ``bench/kernels/gpu_kernels.py``).

The compile mimics Triton's run-time specialisation for the Llama shapes: pointers 16-byte
aligned, strides and sizes divisible by 16, ``M == 1`` folded into a constant (Triton specialises
integer arguments equal to 1).

Usage::

    python -m lightinfer.kernels.audit.sass_stats [--arch 90] [--json PATH]

Must run with ``TRITON_INTERPRET`` unset (it compiles the kernels).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from typing import Any

from .compile import compile_spec, json_constexprs, registers


def hot_loop(sass: str) -> list[str]:
    """The instructions of the longest loop in ``sass`` (label ... backward ``BRA`` to it)."""
    lines = [re.sub(r"^[^\t]*\t", "", line).strip() for line in sass.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.?L\w+):", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA (\.?L\w+)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > len(best):
            best = [x for x in lines[labels[m.group(1)] + 1:i + 1] if x and not x.endswith(":")]
    return best


def opcode_counts(body: list[str]) -> collections.Counter:
    """Instructions by base opcode (``LDG.E.128`` -> ``LDG``), predicates stripped."""
    counts: collections.Counter = collections.Counter()
    for line in body:
        line = re.sub(r"^@!?U?P\w+\s+", "", line)
        counts[line.split()[0].split(".")[0].rstrip(";")] += 1
    return counts


def loop_stats(spec: Any, arch: int, per_thread: float, unit: str, one: tuple[str, ...] = ()) -> dict[str, Any]:
    """Compile ``spec`` and count its hot loop: instructions per ``unit`` (``per_thread`` units per thread
    per iteration), registers, shared memory and the count of every opcode."""
    from triton.tools.disasm import get_sass

    compiled = compile_spec(spec, arch, one)
    body = hot_loop(get_sass(compiled.asm["cubin"]))
    counts = opcode_counts(body)
    total = sum(counts.values())
    return {
        "name": spec.name,
        "constexprs": json_constexprs(spec),
        "specialised_to_1": list(one),
        "num_warps": spec.num_warps,
        "loop_instructions": total,
        "unit": unit,
        "units_per_thread": per_thread,
        "instructions_per_unit": round(total / per_thread, 3),
        "registers": registers(compiled.asm["cubin"]),
        "shared": int(compiled.metadata.shared),
        "opcodes": dict(counts.most_common()),
    }


def collect(arch: int = 90) -> list[dict[str, Any]]:
    """Hot-loop statistics of the W4A16 GEMV (M=1, 2), tiled and swap-AB kernels (integer zero points, then
    fractional ones: ``INTEGER_ZEROS`` in the row's constexprs) and of paged-attention decode."""
    from .specs import attention_specs, w4a16_specs

    rows = []
    for spec in w4a16_specs():
        ce = spec.constexprs
        threads = 32 * spec.num_warps
        if spec.name.startswith("w4a16_gemv") and ce["SPLIT"]:
            one = ("M",) if ce["BLOCK_M"] == 1 else ()
            rows.append(loop_stats(spec, arch, ce["BLOCK_N"] * ce["GROUP_SIZE"] / threads, "weight", one))
        elif spec.name.startswith(("w4a16_tiled", "w4a16_swap_ab")) and ce["GROUP_SIZE"] == 128 and not ce["SPLIT"]:
            rows.append(loop_stats(spec, arch, ce["BLOCK_N"] * ce["BLOCK_K"] / threads, "weight"))
    for spec in attention_specs():
        ce = spec.constexprs
        if (spec.name.startswith("attn_decode[") and ce["BLOCK_D"] == 128 and ce["GROUP"] == 4 and not ce["SPLIT"]
                and ce["BLOCK_SIZE"] == 16):
            cache_bytes = 2 * ce["BLOCK_N"] * ce["BLOCK_D"] * (1 if ce["QUANT"] else 2)  # K and V tiles
            # The engine's INT8 scales are head-major on GPUs: a head's tokens are 1 apart (Triton folds 1).
            one = ("stride_so",) if ce["QUANT"] else ()
            rows.append(loop_stats(spec, arch, cache_bytes / (32 * spec.num_warps), "cache byte", one))
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI: one line per kernel configuration; ``--json`` also writes the rows."""
    import triton

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, choices=(80, 86, 89, 90))
    p.add_argument("--json", default=None, help="write the rows (with the triton version) to this file")
    args = p.parse_args(argv)
    rows = collect(args.arch)
    for r in rows:
        ce = r["constexprs"]
        shape = " ".join(f"{k}={ce[k]}" for k in ("GROUP_SIZE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "QUANT") if k in ce)
        ones = "".join(f" {n}=1" for n in r["specialised_to_1"]) + ("" if ce.get("INTEGER_ZEROS", True) else " frac-z")
        print(f"{r['name']:<30} {shape} w={r['num_warps']}{ones:<12} {r['loop_instructions']:>5} instr/iter  "
              f"{r['instructions_per_unit']:>5.2f} per {r['unit']:<10}  regs {r['registers']:>3}  "
              f"{', '.join(f'{k} {v}' for k, v in list(r['opcodes'].items())[:6])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": f"sm_{args.arch}", "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
