"""Programmatic dependent launch's safety, on the machine code: every kernel waits before it touches memory.

Compiles for sm_90 without a GPU (``kernels/audit/pdl_check.py``, in a subprocess with TRITON_INTERPRET unset).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.audit  # minutes of ptxas compiles: `make test-audit` / `make test-all`, not `make test`


def test_every_kernel_waits_before_touching_memory() -> None:
    """Compiled for sm_90 with PDL on, each kernel's SASS waits (ACQBULK) before its first global load or
    store and releases the next kernel (PREEXIT): nothing can read a buffer the previous kernel is still
    writing, or overwrite one it is still reading. The W4 GEMMs' L2 prefetches of weights come before it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "lightinfer.kernels.audit.pdl_check", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in rows} >= {"w4a16_gemv", "w4a16_tiled", "w4a16_swap_ab", "w4a16_split_k_reduce",
                                           "w4_dequant", "attn_decode", "attn_decode_reduce", "attn_prefill",
                                           "store_kv", "rms_norm", "rotary_qk", "silu_and_mul", "rope_store",
                                           "fused_moe"}
    assert [r for r in rows if not (r["waits"] and r["releases"] and r["wait_before_memory"])] == []
    # Only the W4 GEMMs prefetch (their weight slices, into L2) before the wait.
    assert {r["kernel"] for r in rows if r["prefetches_before_wait"]} == {"w4a16_gemv", "w4a16_tiled", "w4a16_swap_ab"}
    assert proc.returncode == 0, proc.stderr[-3000:]
