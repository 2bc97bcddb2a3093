"""The checkout's ``kernels/`` folder and the ``bench/kernels/`` package must not shadow the installed ``kernels``
distribution that transformers (>= 5) imports: a shadowed one fails every config read."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    importlib.metadata.distribution("kernels")
    HAS_HUB_KERNELS = True
except importlib.metadata.PackageNotFoundError:
    HAS_HUB_KERNELS = False


@pytest.mark.skipif(not HAS_HUB_KERNELS, reason="the kernels distribution is not installed")
@pytest.mark.parametrize("cwd", [ROOT, ROOT / "bench"])
def test_lightinfer_leaves_the_installed_kernels_distribution_importable(cwd: Path) -> None:
    code = ("import sys; sys.path.insert(0, '.'); import lightinfer, kernels; "
            "print(kernels.__file__); import lightinfer.kernels.reference")
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=False,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    where = Path(out.stdout.strip().splitlines()[-1]).resolve()
    assert "site-packages" in where.parts, where  # the distribution, not kernels/ or bench/kernels/
