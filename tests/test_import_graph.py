"""The house has no circles: fdx's import graph, walked with ``ast``.

Every ``import``/``from ... import`` of an ``fdx`` module counts -- at
module level, inside functions, and under ``if TYPE_CHECKING:`` (a type-only
import is still a dependency a reader follows) -- as an edge to the module
it names (``from pkg import mod`` names ``pkg.mod`` when that is a module).

* the graph has no cycle (each strongly connected component is one module);
* ``fdx/core`` (the kernel) imports no ``fdx.plugins`` module and nothing of
  ``fdx.router`` or ``fdx.model`` (``fdx.server``: only the type of the
  ``fdx_add_routes`` hook's client, under ``TYPE_CHECKING``).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "fdx").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """``module -> {imported fdx module: first line}``."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = resolve(t) if t.startswith("fdx") else None
                if r is not None and r != mod:
                    graph[mod].setdefault(r, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_known_edges() -> None:
    g = import_graph()
    assert "fdx.core.engine" in g["fdx.core.engine_proc"]  # a function-level import
    assert "fdx.core.messages" in g["fdx.core.interfaces"]


def test_fdx_has_no_import_cycle() -> None:
    g = import_graph()
    found = cycles(g)
    detail = [" / ".join(f"{a} -> {b} (line {g[a][b]})" for a in comp for b in comp if b in g[a]) for comp in found]
    assert not found, detail


def test_the_kernel_imports_no_plugin_router_or_model_module() -> None:
    g = import_graph()
    bad = [f"{m} -> {t} (line {n})" for m, deps in g.items() if m.startswith("fdx.core")
           for t, n in deps.items() if t.startswith(("fdx.plugins", "fdx.router", "fdx.model"))]
    bad += [f"{m} -> {t}" for m, deps in g.items() if m.startswith("fdx.core") for t in deps
            if t.startswith("fdx.server") and (m, t) != ("fdx.core.hookspecs", "fdx.deploy.engine_client")]
    assert not bad, bad
