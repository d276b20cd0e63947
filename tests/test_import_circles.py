"""No import circle anywhere in fleet/ or worker/ (issue 37): counting imports inside functions and
under TYPE_CHECKING, which hide a circle without removing it. The graph is read from the sources'
own import statements (ast), and its strongly connected components must all be single modules."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules() -> dict[str, str]:
    out = {}
    for pkg in ("fleet", "worker"):
        for folder, _, names in os.walk(os.path.join(ROOT, pkg)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[mod.removesuffix(".__init__")] = path
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                edges[mod] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module] if node.module
                                else package[:len(package) - node.level + 1]) if node.level else node.module
                targets = {base} | {f"{base}.{a.name}" for a in node.names}
                edges[mod] |= {t for t in targets if t in mods and t != mod}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                out.append(sorted(comp))
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports_inside_functions_and_under_type_checking():
    edges = graph()
    assert "fleet.client" in edges["fleet.tui.app"]             # imported inside run_tui
    assert "worker.protocol" in edges["worker.files"] and "fleet.config" in edges["fleet.store"]


def test_no_import_circle_in_fleet_or_worker():
    assert circles(graph()) == []
