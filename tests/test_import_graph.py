"""The packages' import graph, read statically from the source (AST; nothing is imported).

* no import cycle among the modules of ``vllm_hybrid_npu`` (the runtime) nor among those of
  ``vllm_hybrid_npu_lab`` (the lab);
* the runtime never imports the lab or ``benchmarks``.

Every import counts: module-level and function-local ``import`` / ``from ... import``, relative
imports, ``importlib.import_module("literal")`` / ``__import__("literal")``, and (for the
runtime/lab boundary) any dotted string literal naming a lab or benchmark module; within a
package, a dotted string literal naming one of its modules is an edge (registries of module
names imported later by ``importlib``). An edge goes
to the deepest module named: ``from a.b import c`` is an edge to ``a.b.c`` when that is a module
of the package, else to ``a.b``; parent packages that Python initialises on the way are not
edges (a package's ``__init__`` importing its submodules is not a cycle with them).

``python tests/test_import_graph.py`` prints the cycles found.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = "vllm_hybrid_npu"
LAB = "vllm_hybrid_npu_lab"
FORBIDDEN_FROM_RUNTIME = (LAB, "benchmarks")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def modules_of(package: str) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` under ``ROOT/package``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path) -> list[tuple[str, int, str]]:
    """``(imported name, line, how)`` for every import in ``path`` (any nesting level).

    ``how`` is ``import``, ``from``, ``import_module`` or ``string``; names are absolute dotted
    names as written (``from a import b`` gives ``a.b``: the caller decides whether that is a
    module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(module, is_package, node.level, node.module)
                if node.level
                else node.module
            )
            found.append((base, node.lineno, "from"))
            found += [(f"{base}.{alias.name}", node.lineno, "from") for alias in node.names
                      if alias.name != "*"]
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if (fname in ("import_module", "__import__") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found.append((node.args[0].value, node.lineno, "import_module"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _DOTTED.match(node.value):
                found.append((node.value, getattr(node, "lineno", 0), "string"))
    return found


def import_graph(package: str) -> dict[str, dict[str, int]]:
    """Edges ``module -> {imported module of the same package: first line}``.

    ``from a import b`` is an edge to ``a.b`` when that is a module, and to ``a`` only for names
    that are not modules. A dotted string literal that starts with the package's name and names
    one of its modules (or something inside one: ``pkg.mod.Class``) is an edge too: registries
    import such names later (``importlib.import_module(name)`` over a tuple of names)."""
    mods = modules_of(package)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        targets: list[tuple[str, int]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve_relative(mod, is_package, node.level, node.module)
                        if node.level else node.module)
                subs = [a.name for a in node.names if f"{base}.{a.name}" in mods]
                targets += [(f"{base}.{s}", node.lineno) for s in subs]
                if len(subs) < len(node.names):  # some names are attributes of ``base``
                    targets.append((base, node.lineno))
            elif isinstance(node, ast.Call):
                func = node.func
                fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if (fname in ("import_module", "__import__") and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)):
                    targets.append((node.args[0].value, node.lineno))
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and _DOTTED.match(node.value) and node.value.split(".")[0] == package):
                # a module named in a string (a registry such as POLICY_MODULES, a
                # ``scheduler_cls`` path) is imported by name later: a dependency all the same
                targets.append((node.value, getattr(node, "lineno", 0)))
        for name, line in targets:
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                cand = ".".join(parts[:k])
                if cand in mods:
                    if cand != mod:
                        graph[mod].setdefault(cand, line)
                    break
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle path
    ``[m0, m1, ..., m0]`` through its members, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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
                comps.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    out = []
    for comp in sorted(comps):
        members = set(comp)
        # a shortest cycle through the component's first member (BFS inside the component)
        start = comp[0]
        prev: dict[str, str] = {}
        frontier = [start]
        seen = {start}
        path = None
        while frontier and path is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        path = [w]
                        while v != start:
                            path.append(v)
                            v = prev[v]
                        path.append(start)
                        path.reverse()
                        break
                    if w in members and w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if path:
                    break
            frontier = nxt
        out.append(path if path else comp)
    return out


def _describe(graph, cycle: list[str]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(hops + [cycle[-1]])


def test_runtime_has_no_import_cycle():
    graph = import_graph(RUNTIME)
    assert len(graph) > 10  # the scan found the package
    found = cycles(graph)
    assert not found, "import cycles in vllm_hybrid_npu:\n" + "\n".join(_describe(graph, c) for c in found)


def test_lab_has_no_import_cycle():
    graph = import_graph(LAB)
    assert len(graph) > 3
    found = cycles(graph)
    assert not found, "import cycles in vllm_hybrid_npu_lab:\n" + "\n".join(_describe(graph, c) for c in found)


def test_runtime_never_imports_the_lab_or_benchmarks():
    bad = []
    for mod, path in modules_of(RUNTIME).items():
        for name, line, how in imports_of(mod, path):
            if name.split(".")[0] in FORBIDDEN_FROM_RUNTIME:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {how} {name}")
    assert not bad, "the runtime reaches the lab / benchmarks:\n" + "\n".join(bad)


# ------------------------------------------------------------------ the scanner's own checks
def test_scanner_sees_local_relative_and_dynamic_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("import importlib\nimportlib.import_module('pkg.sub.c')\n")
    (pkg / "sub" / "__init__.py").write_text("NAMES = ('pkg.a.f',)\n")  # a registry of names
    (pkg / "sub" / "c.py").write_text("def g():\n    from ..a import f\n    x = 'vllm_hybrid_npu_lab.cli'\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph("pkg")
    assert graph == {"pkg": {"pkg.a": 1}, "pkg.a": {"pkg.b": 2}, "pkg.b": {"pkg.sub.c": 2},
                     "pkg.sub": {"pkg.a": 1}, "pkg.sub.c": {"pkg.a": 2}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    assert cycles({"x": {"y": 1}, "y": {}}) == []
    strings = [n for n, _, how in imports_of("pkg.sub.c", pkg / "sub" / "c.py") if how == "string"]
    assert strings == ["vllm_hybrid_npu_lab.cli"]


if __name__ == "__main__":
    for package in (RUNTIME, LAB):
        g = import_graph(package)
        for c in cycles(g):
            print(f"{package}: {_describe(g, c)}")
