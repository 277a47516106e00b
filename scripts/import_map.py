"""qpass's import map: every module under src/qpass, what it imports, and the layer rules.

Parses each module with ``ast`` (nothing is imported or executed) and records an edge for every
``import`` / ``from ... import`` naming a qpass module, **including imports inside functions** and
string targets of ``importlib.import_module(...)`` / ``__import__(...)``. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``. The implicit import of parent
packages is not an edge.

Layers: ``backends`` = ``qpass.backends`` and below, ``apps`` = ``qpass.apps`` and below, ``core`` =
everything else. Rules (docs/DESIGN.md, "Import map and seams"):

1. core never imports backends or apps;
2. backends never import apps;
3. ``qpass.runtime`` never imports ``qpass.passes``;
4. no cycle among modules;
5. no module imports a moved module's old path. A shim left at an old path is a file whose body is
   ``moved(__name__, "<old>", "<new>")`` (:mod:`qpass._moved`); :func:`moved_aliases` reads those
   calls, the graph gets the edge old -> new, and that one edge is exempt from rules 1-2 (the
   shims in ``backends/triton`` alias modules that moved to ``apps/bench``). ``PENDING`` lists the
   importers of old paths that are still to be updated (each one an edge that must exist).

Usage: ``python scripts/import_map.py [--edges]``: prints the layer-to-layer map (and every edge
with ``--edges``), the pending old-path imports and the violations; exit 1 if there are any.
Tested by tests/test_import_map.py.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"

# Importers of moved modules' old paths not yet updated (rule 5), (importer, old path); each row
# must match a real edge (a stale row fails tests/test_import_map.py). Empty: every importer moved.
PENDING: frozenset[tuple[str, str]] = frozenset()


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """``{module name: path}`` for every ``.py`` under ``root/qpass``."""
    out = {}
    for p in sorted((root / "qpass").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(mod: str, path: Path, modules: set[str]) -> set[str]:
    """The qpass modules ``mod`` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def add(name: str) -> None:
        while name and name not in modules:  # `import qpass.a.b.attr` -> the longest module prefix
            name = name.rpartition(".")[0]
        if name.startswith("qpass"):
            out.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "qpass":
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_pkg, node.level, node.module)
            if base.split(".")[0] != "qpass":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                add(sub if sub in modules else base)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str) \
                    and node.args[0].value.startswith("qpass"):
                add(node.args[0].value)
    out.discard(mod)
    return out


def layer(mod: str) -> str:
    if mod == "qpass.backends" or mod.startswith("qpass.backends."):
        return "backends"
    if mod == "qpass.apps" or mod.startswith("qpass.apps."):
        return "apps"
    return "core"


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def moved_aliases(root: Path = ROOT) -> dict[str, str]:
    """``{old path: new path}`` of every shim: a module with a top-level call
    ``moved(__name__, "<old>", "<new>")`` (string constants).

    Raises:
        ValueError: a shim declares an old path that is not its own module name.
    """
    out = {}
    for mod, path in module_files(root).items():
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            call = node.value if isinstance(node, ast.Expr) else None
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "moved" and len(call.args) == 3):
                continue
            old, new = (a.value if isinstance(a, ast.Constant) else None for a in call.args[1:])
            if old != mod or not isinstance(new, str):
                raise ValueError(f"{path}: moved() must name its own module {mod!r} and a string target, got {old!r}, {new!r}")
            out[old] = new
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: {imported qpass modules}}``; a shim's edge to the module it aliases included."""
    files = module_files(root)
    names = set(files)
    graph = {m: imports_of(m, p, names) for m, p in files.items()}
    for old, new in moved_aliases(root).items():
        graph[old].add(new)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def violations(graph: dict[str, set[str]], allowed: set[tuple[str, str]] | frozenset = frozenset(),
               aliases: dict[str, str] | None = None) -> list[str]:
    """Every broken rule, one line each (``rule: a -> b``; cycles list their modules).

    ``allowed``: edges ``(a, b)`` to leave out of the graph first (a temporary, explicit allow-list,
    e.g. ``PENDING``). ``aliases``: :func:`moved_aliases` of the same tree (without it a shim's edge
    to its new module counts like any other edge).
    """
    aliases = aliases or {}
    graph = {a: {b for b in bs if (a, b) not in allowed} for a, bs in graph.items()}
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if b in aliases:
                out.append(f"moved: {a} -> {b} (import {aliases[b]})")
            if aliases.get(a) == b:
                continue  # the shim's own alias edge
            la, lb = layer(a), layer(b)
            if la == "core" and lb in ("backends", "apps"):
                out.append(f"core->{lb}: {a} -> {b}")
            elif la == "backends" and lb == "apps":
                out.append(f"backends->apps: {a} -> {b}")
            if _under(a, "qpass.runtime") and _under(b, "qpass.passes"):
                out.append(f"runtime->passes: {a} -> {b}")
    for comp in cycles(graph):
        out.append("cycle: " + " <-> ".join(comp))
    return out


def layer_map(graph: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    """Edge counts between layers (``("apps", "core") -> n``)."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for a, bs in graph.items():
        for b in bs:
            counts[(layer(a), layer(b))] += 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/import_map.py", description=__doc__.split("\n")[0])
    ap.add_argument("--edges", action="store_true", help="print every module's qpass imports")
    a = ap.parse_args(argv)
    g = import_graph()
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} import edges")
    for (la, lb), n in layer_map(g).items():
        print(f"  {la:>8} -> {lb:<8} {n:4d}")
    if a.edges:
        for m in sorted(g):
            print(f"{m} -> {', '.join(sorted(g[m])) or '-'}")
    aliases = moved_aliases()
    print(f"{len(aliases)} moved module(s) with a shim at the old path, {len(PENDING)} pending old-path import(s)")
    for a, b in sorted(PENDING):
        print(f"  pending: {a} -> {b} (import {aliases.get(b, '?')})")
    bad = violations(g, PENDING, aliases)
    print(f"{len(bad)} violation(s)")
    for v in bad:
        print("  " + v)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
