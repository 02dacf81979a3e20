"""The package layout, checked from source with `ast` (nothing is imported).

Every `import` statement counts, wherever it sits: inside a function (a lazy import), under
`if TYPE_CHECKING:` or at the top. A circle through a lazy or type-only import still means two
modules cannot be read, tested or moved one without the other.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("libs", "kernels", "protos", "services")

# Pairs removed by other parts of issue #10; exempt here until those branches merge.

# A pure core: no tensors and no IO (sockets, processes, files, the bus, the transfer engine).
IO_MODULES = {
    "torch", "numpy", "asyncio", "socket", "selectors", "ssl", "subprocess", "multiprocessing", "threading",
    "io", "os", "pathlib", "shutil", "tempfile", "sqlite3", "http", "urllib", "nats", "ucxx", "fastapi",
    "uvicorn", "httpx", "aiohttp", "requests", "psutil", "prometheus_client", "safetensors", "libs.bus",
    "libs.transfer", "libs.service", "services",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Dotted names the module imports, anywhere in it (relative imports resolved). `from a.b import c`
    names `a.b.c` when that is a project module and `a.b` otherwise; a package stands for its `__init__`."""
    modules = _modules()
    path = modules[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return found


@cache
def _graph() -> dict[str, frozenset[str]]:
    """module -> the project modules it imports."""
    modules = _modules()
    return {name: frozenset(t for t in _imports(name) if t in modules and t != name) for name in modules}


def _cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _pairs(graph: dict[str, frozenset[str]]) -> set[frozenset[str]]:
    return {frozenset({a, b}) for a, targets in graph.items() for b in targets if a in graph.get(b, ())}


def _in(prefix: str) -> list[str]:
    return [m for m in _modules() if m == prefix or m.startswith(prefix + ".")]


def _hits(modules: list[str], banned: set[str]) -> list[str]:
    return sorted(f"{m} imports {imp}" for m in modules for imp in _imports(m)
                  if any(imp == b or imp.startswith(b + ".") for b in banned))


def test_graph_sees_known_edges():
    """Guards the parser itself: relative, lazy and `from pkg import module` imports are all edges."""
    graph = _graph()
    assert "libs.transfer.frames" in graph["libs.transfer.connection"]  # relative import
    assert "kernels.flashinfer_attn" in graph["kernels.attention"]  # lazy import inside a function
    assert "kernels.attention" in graph["kernels"]  # package __init__
    assert _pairs({"a": frozenset({"b"}), "b": frozenset({"a"}), "c": frozenset({"a"})}) == {frozenset("ab")}
    assert _cycles({"a": frozenset("b"), "b": frozenset("c"), "c": frozenset("a"), "d": frozenset("a")}) == [
        ["a", "b", "c"]]


def test_no_two_modules_import_each_other():
    circles = sorted(sorted(p) for p in _pairs(_graph()))
    assert circles == [], f"modules importing each other: {circles}"


def test_no_longer_import_cycles():
    cycles = _cycles(_graph())
    assert cycles == [], f"import cycles: {cycles}"


def _package(module: str) -> str:
    """The package a module belongs to: `libs.engine.parallel.rank` -> `libs.engine`, `kernels.moe` -> `kernels`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("libs", "services") and len(parts) > 1 else parts[0]


def test_no_package_import_cycles():
    """Packages form a layering too: no two packages (libs.engine, libs.routing, ...) reach each other."""
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        here = _package(module)
        packages.setdefault(here, set()).update(t for t in map(_package, targets) if t != here)
    cycles = _cycles({p: frozenset(t) for p, t in packages.items()})
    assert cycles == [], f"package import cycles: {cycles}"


def test_kvcache_is_pure():
    assert _hits(_in("libs.kvcache"), IO_MODULES) == []


def test_routing_is_pure():
    """libs/routing decides from plain values: no IO, no torch, no wire models (the router service converts)."""
    assert _hits(_in("libs.routing"), IO_MODULES | {"protos", "pydantic", "libs.engine"}) == []


def test_engine_knows_neither_wire_nor_transfer():
    assert _hits(_in("libs.engine"), {"protos", "libs.transfer"}) == []


def test_transfer_wire_core_is_pure():
    """The frame codecs and protocol vocabulary are pure (no torch, no IO): they are the contract."""
    wire_core = ["libs.transfer.protocol", "libs.transfer.frames", "libs.transfer.errors"]
    assert _hits(wire_core, IO_MODULES - {"libs.transfer"}) == []


# libs/transfer, bottom to top (docs/transfer.md "Layout"): each module imports only modules before it.
TRANSFER_LAYERS = [
    "errors", "config", "protocol", "frames", "buffers", "transfers", "api", "registry", "backends",
    "backends.base", "backends.tcp", "backends.ucx", "connection", "engine",
]


def test_transfer_modules_import_only_lower_layers():
    order = {f"libs.transfer.{m}": i for i, m in enumerate(TRANSFER_LAYERS)}
    assert set(order) == set(_in("libs.transfer")) - {"libs.transfer"}, "update TRANSFER_LAYERS and the docs"
    upward = sorted(f"{m} imports {t}" for m in order for t in _graph()[m] if order.get(t, -1) >= order[m])
    assert upward == []


def test_no_class_name_is_defined_twice():
    """One name per concept: a top-level class (or enum) name is defined in one module only."""
    where: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    assert {n: m for n, m in where.items() if len(m) > 1} == {}


def test_ruff_passes():
    """ruff's rules, line length (E501) included, hold everywhere: CI runs only `make test`."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", str(ROOT)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
