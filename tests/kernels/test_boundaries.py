"""The kernels package's boundaries, checked from the source: what it imports and what importing it costs.

* ``import lightinfer.kernels`` (and the two PyTorch backends) must not import Triton: seconds on a CPU.
* Nothing in ``kernels/`` imports from ``lightinfer`` outside ``kernels/`` (kernels are the bottom layer).
* Run-time kernel modules never import ``kernels/audit/`` (build-time tooling imports them, not the reverse).
* No module imports another's private (``_name``) names: what is shared is public.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightinfer.kernels

KERNELS_DIR = Path(lightinfer.kernels.__file__).resolve().parent


def _modules() -> list[tuple[Path, list[str]]]:
    """Every ``.py`` under ``kernels/`` with its package as dotted parts (``["lightinfer", "kernels", ...]``)."""
    out = []
    for path in sorted(KERNELS_DIR.rglob("*.py")):
        rel = path.relative_to(KERNELS_DIR).parent.parts
        out.append((path, ["lightinfer", "kernels", *rel]))
    return out


def _imports(path: Path, package: list[str]) -> list[tuple[str, list[str], int]]:
    """``(absolute module, imported names, line)`` of every import in ``path``, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def test_kernels_import_nothing_of_lightinfer_outside_kernels() -> None:
    bad = []
    for path, package in _modules():
        for module, names, line in _imports(path, package):
            targets = [module] if module != "lightinfer" else [f"lightinfer.{n}" for n in names]
            bad += [f"{path.name}:{line} imports {t}" for t in targets
                    if t.split(".")[0] == "lightinfer" and not t.startswith("lightinfer.kernels")]
    assert not bad, "\n".join(bad)


def test_run_time_kernels_never_import_the_audit() -> None:
    bad = []
    for path, package in _modules():
        if "audit" in package:
            continue
        for module, names, line in _imports(path, package):
            targets = [module, *(f"{module}.{n}" for n in names)]
            if any(t == "lightinfer.kernels.audit" or t.startswith("lightinfer.kernels.audit.") for t in targets):
                bad.append(f"{path.name}:{line} imports the audit")
    assert not bad, "\n".join(bad)
    assert len([p for p in _modules() if "audit" in p[1]]) >= 5  # the check saw the audit package


def test_no_private_names_cross_modules() -> None:
    bad = []
    for path, package in _modules():
        for module, names, line in _imports(path, package):
            bad += [f"{path.name}:{line} imports {module}.{n}" for n in names if n.startswith("_")
                    and not n.startswith("__") and module.startswith("lightinfer")]
    assert not bad, "\n".join(bad)


def test_importing_the_kernels_and_cpu_backends_does_not_import_triton() -> None:
    code = ("import sys\n"
            "import lightinfer.kernels as k\n"
            "from lightinfer.kernels import KVCacheSpec, PagedKV, SplitKPartials, switches\n"
            "k.get_backend('torch_cpu'), k.get_backend('reference')\n"
            "import lightinfer.layers.ops\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
