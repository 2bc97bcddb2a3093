"""The property programmatic dependent launch's safety rests on, checked on the machine code.

Under PDL (``kernels/pdl.py``) a kernel's programs start before the previous kernel has finished; each
must wait (``griddepcontrol.wait``, SASS ``ACQBULK``) before its first global load or store, and release
the next kernel (``griddepcontrol.launch_dependents``, ``PREEXIT``). :func:`wait_order` compiles one launch
spec of every kernel for sm_90 with ``USE_PDL=True`` and reads both off the SASS. Usage::

    python -m lightinfer.kernels.audit.pdl_check [--arch 90]

Must run with ``TRITON_INTERPRET`` unset (it compiles the kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from .compile import compile_spec
from .specs import all_launch_specs

# Global-memory instructions in SASS: none may come before the wait (ACQBULK) in a PDL kernel. (L2 prefetches,
# CCTL.E.PF2, read nothing into the program and touch only weights, which no kernel writes.)
_GLOBAL_MEMORY = re.compile(r"\b(LDG|STG|LDGSTS|LD|ST|ATOMG|ATOM|RED|UBLKCP|UTMALDG|UTMASTG)\b")


def wait_order(arch: int = 90) -> list[dict[str, Any]]:
    """For one launch spec of every kernel, compiled for ``sm_<arch>`` with ``USE_PDL=True``: whether the
    SASS waits (``ACQBULK``, from ``griddepcontrol.wait``) before its first global-memory instruction, and
    releases the next kernel (``PREEXIT``, from ``griddepcontrol.launch_dependents``). The property PDL's
    safety rests on, checked on the machine code rather than trusted to the source.

    Raises:
        RuntimeError: under ``TRITON_INTERPRET=1`` (nothing to compile).
    """
    from triton.tools.disasm import get_sass

    rows, seen = [], set()
    for spec in all_launch_specs():
        kernel = spec.name.split("[")[0]
        if kernel in seen:
            continue
        seen.add(kernel)
        flags = {name: True for name in ("USE_PDL", "PREFETCH") if name in spec.kernel.arg_names}
        spec = dataclasses.replace(spec, signature={**spec.signature, **dict.fromkeys(flags, "constexpr")},
                                   constexprs={**spec.constexprs, **flags})
        lines = [line.split("\t")[-1].strip() for line in get_sass(compile_spec(spec, arch).asm["cubin"]).splitlines()]
        first_wait = next((i for i, op in enumerate(lines) if op.startswith("ACQBULK")), None)
        first_memory = next((i for i, op in enumerate(lines) if _GLOBAL_MEMORY.search(op)), None)
        rows.append({"kernel": kernel, "waits": first_wait is not None,
                     "releases": any(op.startswith("PREEXIT") for op in lines),
                     "wait_before_memory": first_wait is not None and (first_memory is None or first_wait < first_memory),
                     # L2 prefetches of weights (CCTL.E.PF2), the one thing allowed before the wait
                     "prefetches_before_wait": sum(bool(re.match(r"(@!?P\w+\s+)?CCTL", op))
                                                   for op in lines[:first_wait or 0])})
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m lightinfer.kernels.audit.pdl_check [--arch 90]`` prints :func:`wait_order` as one JSON line;
    status 1 if a kernel touches memory before its wait."""
    p = argparse.ArgumentParser(description="Check that every kernel waits before it touches memory under PDL")
    p.add_argument("--arch", type=int, default=90, choices=(90,))
    rows = wait_order(p.parse_args(argv).arch)
    print(json.dumps(rows))
    return 0 if all(r["wait_before_memory"] and r["releases"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
