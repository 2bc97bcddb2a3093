"""Every kernel configuration the launchers can pick fits a consumer card's shared memory and
registers (sm_86).

Compiles for ``GPUTarget("cuda", 86, 32)`` without a GPU (ptxas ships in the triton wheel). Runs
``kernels/audit/smem_check.py`` in a subprocess with TRITON_INTERPRET unset: under the interpreter
``@triton.jit`` yields objects that cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.audit  # minutes of ptxas compiles: `make test-audit` / `make test-all`, not `make test`


def test_all_configs_fit_sm86_shared_memory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "lightinfer.kernels.audit.smem_check", "--arch", "86", "--json"],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {r["name"].split("[")[0] for r in rows}
    assert {"w4a16_gemv", "w4a16_tiled", "w4_dequant", "attn_decode", "attn_decode_reduce", "attn_prefill",
            "store_kv", "rms_norm", "rotary_qk", "silu_and_mul", "w4a16_split_k_reduce", "rope_store",
            "w4a16_swap_ab", "w8a16", "fused_moe"} <= names
    too_big = [r for r in rows if not r["fits"]]
    assert not too_big, "configs over the sm_86 limit (99 KB):\n" + "\n".join(map(str, too_big))
    # Out of registers, ptxas spills to local memory; the INT8 prefill at the fp16 tile did (255
    # registers, 114 spill stores in the kernel at head_dim 128) until it got its own configurations.
    assert all(0 < r["registers"] <= 255 for r in rows)
    spilling = [r for r in rows if r["spill_stores"]]
    assert not spilling, "configs that spill registers on sm_86:\n" + "\n".join(map(str, spilling))
