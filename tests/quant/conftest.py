"""Fixtures for the quantization tests: the optional AutoAWQ 0.2.9 oracle, tiny checkpoints.

The oracle is AutoAWQ's own source, used only by tests and never committed. Fetch it with::

    .venv/bin/pip download --no-deps autoawq==0.2.9 -d .oracle
    tar xzf .oracle/autoawq-0.2.9.tar.gz -C .oracle

(``.oracle/`` is git-ignored.) Without it the oracle tests skip and say so. Its modules are
loaded from their files with the few ``awq.utils`` helpers they import stubbed, so that
AutoAWQ's heavy dependencies (accelerate, datasets) are not needed.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ORACLE_ROOT = Path(__file__).resolve().parents[2] / ".oracle" / "autoawq-0.2.9" / "awq"
ORACLE_HINT = ("AutoAWQ oracle absent: pip download --no-deps autoawq==0.2.9 -d .oracle && "
               "tar xzf .oracle/autoawq-0.2.9.tar.gz -C .oracle")


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def awq_oracle() -> types.SimpleNamespace:
    """``.gemm`` (WQLinear_GEMM, whose ``from_linear`` packs) and ``.triton`` (awq_gemm_kernel)."""
    if not (ORACLE_ROOT / "modules" / "linear" / "gemm.py").is_file():
        pytest.skip(ORACLE_HINT)
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    stubs = {n: types.ModuleType(n) for n in ("awq", "awq.utils", "awq.modules", "awq.modules.triton")}
    for s in stubs.values():
        s.__path__ = []  # packages
    module_utils = types.ModuleType("awq.utils.module")
    module_utils.try_import = lambda name: (None, f"{name} not installed")
    utils_utils = types.ModuleType("awq.utils.utils")
    utils_utils.get_best_device = lambda: "cpu"
    sys.modules.update(stubs)
    sys.modules["awq.utils.module"] = module_utils
    sys.modules["awq.utils.utils"] = utils_utils
    try:
        _load("awq.utils.packing_utils", ORACLE_ROOT / "utils" / "packing_utils.py")
        triton_gemm = _load("awq.modules.triton.gemm", ORACLE_ROOT / "modules" / "triton" / "gemm.py")
        gemm = _load("awq.modules.linear.gemm", ORACLE_ROOT / "modules" / "linear" / "gemm.py")
    finally:
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return types.SimpleNamespace(gemm=gemm, triton=triton_gemm)
