"""The import direction, checked from the source with ``ast``: no module imports a layer above its
own, and no modules import each other in a circle.

    kernels  <-  layers  <-  models  <-  engine  <-  llm / entrypoints  <-  webui / cli

Every import statement counts, also those inside functions and under ``if TYPE_CHECKING``: a lazy
import still ties the two modules together. Modules are named as installed (pyproject's
``package-dir`` maps ``kernels/`` to ``lightinfer.kernels`` and so on).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. Each layer lists the layers it may import besides its own; whatever is not listed is
# a back-edge. A module belongs to the layer of its longest listed prefix ("lightinfer" alone is the
# package's __init__: the public API, which re-exports from every layer).
LAYERS: dict[str, tuple[list[str], set[str]]] = {
    # run-time kernels and their launchers: nothing of lightinfer outside kernels/
    "kernels": (["lightinfer.kernels"], set()),
    # plain settings and data that every layer may read: engine settings (speculative_config too), sampling settings, outputs,
    # the input layer (prompts / messages -> checked requests), structured-output specs and matchers, and
    # the table of run-time weight layouts (formats.scheme: plain data that make_linear reads)
    "foundation": (["lightinfer.config", "lightinfer.speculative_config", "lightinfer.sampling_params", "lightinfer.outputs", "lightinfer.inputs",
                    "lightinfer.structured", "lightinfer.formats.scheme"], {"kernels"}),
    # torch modules that call the kernels (linear, attention, norm, rotary, sampler, ...)
    "layers": (["lightinfer.layers"], {"kernels", "foundation"}),
    # network descriptions: only layers, never the kernels behind them
    "models": (["lightinfer.models"], {"layers", "foundation"}),
    # checkpoints into models: reading formats, dummy weights, the offline quantizer
    "loading": (["lightinfer.loader", "lightinfer.formats", "lightinfer.dummy_weights", "lightinfer.quant"],
                {"models", "layers", "kernels", "foundation"}),
    # scheduler, block manager, model runner, LLMEngine, AsyncLLMEngine
    "engine": (["lightinfer.engine"], {"loading", "models", "layers", "kernels", "foundation"}),
    # what callers use: the Python API, the HTTP API, perplexity evaluation
    "frontends": (["lightinfer.llm", "lightinfer.entrypoints", "lightinfer.evaluate"],
                  {"engine", "loading", "models", "layers", "kernels", "foundation"}),
    # the top: chat UI, command line, the package's public names
    "apps": (["lightinfer.webui", "lightinfer.cli", "lightinfer"],
             {"frontends", "engine", "loading", "models", "layers", "kernels", "foundation"}),
}

# Edges that break the rules today and are owned by work in progress elsewhere; the lead empties this
# set when that work merges. Each entry is (importing module, imported module).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def package_dirs() -> dict[str, Path]:
    """``{package name: folder}`` from pyproject's ``[tool.setuptools] package-dir``."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


def source_modules() -> dict[str, Path]:
    """Every installed module's dotted name and file (a package's ``__init__.py`` under the package's name)."""
    modules: dict[str, Path] = {}
    for name, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([name, *parts])] = path
    return modules


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The lightinfer modules ``module`` imports anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            for alias in node.names:  # `from pkg import submodule` imports pkg.submodule
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m == "lightinfer" or m.startswith("lightinfer.")} - {module}


def layer_of(module: str) -> str | None:
    """The layer whose longest prefix matches ``module`` (None: in no layer)."""
    best, best_len = None, -1
    for layer, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            matches = module == prefix or (prefix != "lightinfer" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules)
    graph = {m: imports_of(m, p, known) for m, p in modules.items()}
    return {m: {d for d in deps if (m, d) not in KNOWN_VIOLATIONS} for m, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = sorted(m for m in source_modules() if layer_of(m) is None)
    assert not unplaced, f"add these modules to a layer in LAYERS: {unplaced}"


def test_no_import_goes_up_a_layer() -> None:
    back_edges = []
    for module, deps in import_graph().items():
        layer = layer_of(module)
        allowed = LAYERS[layer][1] | {layer} if layer else set()
        for dep in sorted(deps):
            dep_layer = layer_of(dep)
            if dep_layer is not None and dep_layer not in allowed:
                back_edges.append(f"{module} ({layer}) imports {dep} ({dep_layer})")
    assert not back_edges, "imports against the layer order:\n" + "\n".join(back_edges)


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_known_violations_still_exist() -> None:
    """An entry that no longer matches an import is stale: remove it, so that it cannot hide a new one."""
    modules = source_modules()
    known = set(modules)
    stale = sorted(edge for edge in KNOWN_VIOLATIONS
                   if edge[0] not in modules or edge[1] not in imports_of(edge[0], modules[edge[0]], known))
    assert not stale, f"remove these from KNOWN_VIOLATIONS, they are fixed: {stale}"


def test_every_package_folder_is_installed() -> None:
    """A folder of modules missing from pyproject's ``packages`` works from the checkout and is absent
    from the installed wheel."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in source_modules().items() if p.name == "__init__.py"}
    assert packages <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(packages - listed)}"


def test_the_checker_sees_a_back_edge_and_a_circle() -> None:
    """The checks above would fail on a bad graph (and the relative-import resolution is right)."""
    assert layer_of("lightinfer.kernels.w4a16_gemm") == "kernels" and layer_of("lightinfer") == "apps"
    assert layer_of("lightinfer.llm") == "frontends" and layer_of("lightinfer.inputs.chat") == "foundation"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    node = ast.parse("from ._common import x\nfrom . import pdl").body
    path = ROOT / "kernels" / "w4a16_gemm.py"
    assert _resolve("lightinfer.kernels.w4a16_gemm", path, node[0]) == "lightinfer.kernels._common"
    assert _resolve("lightinfer.kernels.w4a16_gemm", path, node[1]) == "lightinfer.kernels"
    graph = import_graph()
    assert "lightinfer.engine.llm_engine" in graph["lightinfer.llm"]
    assert "lightinfer.kernels.launch_utils" in graph["lightinfer.kernels.w4a16_gemm"]  # relative import seen
