"""The C ops' AVX2 code, tested on a newer CPU: the CPU parity tests again with the library built for Haswell.

The library is built with -march=native, so on an AVX-512 machine (CI's included) the AVX2 branches of the C
ops never run, while most consumer Intel CPUs have no AVX-512 and take exactly those. Decode attention's dot
product had no AVX2 branch and ran scalar there; this runs the parity tests of every C op with
``LIGHTINFER_CPU_MARCH=haswell`` (AVX2 + FMA) and torch kept to AVX2, in a subprocess (the switches and the
library are per process).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from lightinfer.kernels import cpu_native

HERE = Path(__file__).resolve().parent
PARITY_TESTS = ["test_cpu_native.py", "test_cpu_w4.py", "test_cpu_w4a8.py", "test_cpu_w8.py", "test_cpu_argmax.py",
                "test_cpu_fused.py"]


@pytest.mark.audit  # the six parity files again, for another build target: `make test-audit`, not `make test`
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 target")
@pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler")
def test_the_parity_tests_pass_with_the_ops_built_for_avx2() -> None:
    flags = cpu_native.cpu_flags()
    if "avx2" not in flags:
        pytest.skip("this CPU cannot run AVX2 code")
    if "avx512f" not in flags:
        pytest.skip("this CPU is AVX2-only: the tests run on its AVX2 code anyway")
    env = {**os.environ, "LIGHTINFER_CPU_MARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2",
           "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           *(str(HERE / name) for name in PARITY_TESTS)],
                          cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
