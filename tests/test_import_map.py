"""The import map (scripts/import_map.py): core -/-> backends/apps, backends -/-> apps, runtime -/->
passes, no cycles (lazy in-function imports and importlib string targets count), no import of a
moved module's old path (the shims' own alias edges exempt).

The one allow-list is ``PENDING`` (old-path imports in a file another engineer owns); each of its
edges must exist, so a stale row fails. The checker is proven on a synthetic package that breaks
every rule."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_map():
    spec = importlib.util.spec_from_file_location("qpass_import_map", ROOT / "scripts" / "import_map.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod




def test_qpass_import_map_holds():
    im = _import_map()
    g = im.import_graph()
    assert len(g) > 100 and "qpass.runtime.engine" in g and "qpass.apps.plugins" in g
    bad = im.violations(g, im.PENDING, im.moved_aliases())
    assert bad == [], "\n".join(bad)
    stale = sorted((a, b) for a, b in im.PENDING if b not in g.get(a, ()))
    assert stale == [], f"PENDING rows whose import is gone (delete them from scripts/import_map.py): {stale}"


OLD_TRITON_TOOLING = {
    "qpass.backends.triton.bench": "qpass.apps.bench.triton_bench",
    "qpass.backends.triton.bench_e2e": "qpass.apps.bench.e2e",
    "qpass.backends.triton.peers": "qpass.apps.bench.peers",
    "qpass.backends.triton.selfcheck": "qpass.apps.bench.triton_selfcheck",
    "qpass.backends.triton.moe_check": "qpass.apps.bench.moe_check",
    "qpass.backends.triton.aot": "qpass.apps.bench.aot",
    "qpass.backends.cuda.devcheck": "qpass.apps.bench.cuda_check",
    "qpass.backends.cuda.devcheck_tables": "qpass.apps.bench.cuda_tables",
}


def test_moved_tooling_has_shims_and_no_backend_imports_apps():
    im = _import_map()
    assert im.moved_aliases() == OLD_TRITON_TOOLING
    g = im.import_graph()
    # without the alias exemption exactly the shim edges break "backends -> apps"; nothing else does
    raw = [v for v in im.violations(g, im.PENDING) if v.startswith("backends->apps")]
    assert sorted(raw) == sorted(f"backends->apps: {a} -> {b}" for a, b in OLD_TRITON_TOOLING.items())


def _imported_names(path: Path) -> set[str]:
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_tests_and_scripts_use_the_new_paths():
    im = _import_map()
    old = set(im.moved_aliases())
    files = [*ROOT.glob("tests/*.py"), *ROOT.glob("scripts/**/*.py")]
    assert len(files) > 50
    hits = {str(p.relative_to(ROOT)): sorted(_imported_names(p) & old) for p in files if p.name != "test_moved_shims.py"}
    assert {k: v for k, v in hits.items() if v} == {}


def test_seams_are_where_the_design_says():
    im = _import_map()
    g = im.import_graph()
    assert "qpass.backends.base" in g["qpass.apps.plugins"]  # the one registration path is an app module
    for m in ("qpass.runtime.engine", "qpass.runtime.graph_engine", "qpass.parity.behavior", "qpass.ops"):
        assert not any(im.layer(b) != "core" for b in g[m]), m
    # apps reach engines through the protocol module, not the torch runtime classes
    for m in ("qpass.apps.grpo.grpo", "qpass.apps.study.replay"):
        assert "qpass.runtime.engine" in g[m] and "qpass.runtime.rollout" not in g[m], m


#: import paths the compiler room (src/qpass/compiler/) replaced: each is now a shim module that
#: puts the new module object in sys.modules under the old name (qpass.passes.linear_lower
#: re-exports the same classes); new src code imports the new path.
DEPRECATED_COMPILER_PATHS = {
    "qpass.recipe": "qpass.compiler.recipe",
    "qpass.pipeline": "qpass.compiler.pipeline",
    "qpass.pm": "qpass.compiler.manager",
    "qpass.graph.properties": "qpass.compiler.properties",
    "qpass.graph.verify": "qpass.compiler.verify",
    "qpass.passes": "qpass.compiler.passes",
}
#: src modules still on an old path, in files other work owns (backends/, apps/grpo/): this list may
#: only shrink -- move an entry to the new path when its file is next edited, then delete it here.
STILL_ON_OLD_PATHS: set[tuple[str, str]] = set()


def _deprecated(mod: str) -> bool:
    return any(mod == old or mod.startswith(old + ".") for old in DEPRECATED_COMPILER_PATHS)


def test_no_new_src_use_of_the_old_compiler_paths():
    im = _import_map()
    g = im.import_graph()
    shims = {m for m in g if _deprecated(m)}
    assert shims == {*DEPRECATED_COMPILER_PATHS, *(f"qpass.passes.{n}" for n in
                     ("act_qdq", "weight_qdq", "rac", "fp32_accumulate", "common", "linear_lower"))}
    uses = {(a, b) for a, bs in g.items() if a not in shims for b in bs if _deprecated(b)}
    new = sorted(uses - STILL_ON_OLD_PATHS)
    assert not new, "import the new path: " + "; ".join(
        f"{a} -> {b} (use {next(v + b[len(k):] for k, v in DEPRECATED_COMPILER_PATHS.items() if b == k or b.startswith(k + '.'))})"
        for a, b in new)
    assert not STILL_ON_OLD_PATHS - uses, f"moved to the new path, delete from STILL_ON_OLD_PATHS: {sorted(STILL_ON_OLD_PATHS - uses)}"
    # a shim imports only its new home, never another old path
    for m in shims - {"qpass.passes"}:
        assert g[m] and all(b.startswith("qpass.compiler.") for b in g[m]), (m, g[m])


def test_runtime_never_imports_the_passes_at_their_new_home():
    im = _import_map()
    g = im.import_graph()
    bad = sorted((a, b) for a, bs in g.items() if a.startswith("qpass.runtime") for b in bs
                 if b.startswith("qpass.compiler.passes") or _deprecated(b))
    assert bad == []


def test_old_paths_are_the_same_objects():
    import qpass.compiler.manager
    import qpass.compiler.passes.residual_compensation
    import qpass.compiler.verify
    import qpass.passes.linear_lower
    import qpass.passes.rac
    import qpass.pm
    from qpass.compiler.passes.w4a4_lower import W4A4Lower
    from qpass.graph.verify import verify

    assert qpass.pm is qpass.compiler.manager and qpass.passes.rac is qpass.compiler.passes.residual_compensation
    assert verify is qpass.compiler.verify.verify
    assert qpass.passes.linear_lower.W4A4Lower is W4A4Lower is qpass.pm.PASSES["w4a4_lower"]
    assert sorted(qpass.pm.PASSES) == ["act_qdq", "fp32_accumulate_linear", "fp8_lower", "mxfp4_lower",
                                       "residual_compensation", "w4a16_lower", "w4a4_lower", "weight_qdq"]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, src in files.items():
        p = root / "qpass" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))


def test_checker_finds_every_kind_of_violation(tmp_path):
    im = _import_map()
    _write(tmp_path, {
        "__init__.py": "",
        "core.py": "def f():\n    from qpass.backends import k  # lazy: still an edge\n",
        "other.py": "import importlib\nimportlib.import_module('qpass.apps.app')\n",
        "a.py": "from qpass import b\n",
        "b.py": "def g():\n    from . import a\n",  # relative, lazy: a <-> b
        "runtime/__init__.py": "",
        "runtime/sync.py": "from qpass.passes.lower import X\n",
        "passes/__init__.py": "",
        "passes/lower.py": "X = 1\n",
        "backends/__init__.py": "",
        "backends/k.py": "from qpass.apps.app import main\n",
        "apps/__init__.py": "",
        "apps/app.py": "import qpass.backends.k\nimport qpass.core\n",
        "apps/new.py": "X = 1\n",
        "backends/old.py": "from qpass._moved import moved\nmoved(__name__, 'qpass.backends.old', 'qpass.apps.new')\n",
        "_moved.py": "def moved(*a):\n    pass\n",
        "apps/user.py": "def h():\n    import qpass.backends.old  # lazy: still an edge\n",
    })
    g = im.import_graph(tmp_path)
    assert g["qpass.core"] == {"qpass.backends.k"} and g["qpass.b"] == {"qpass.a"}
    aliases = im.moved_aliases(tmp_path)
    assert aliases == {"qpass.backends.old": "qpass.apps.new"}
    assert g["qpass.backends.old"] == {"qpass._moved", "qpass.apps.new"}
    bad = im.violations(g, aliases=aliases)
    assert sorted(bad) == sorted([
        "core->backends: qpass.core -> qpass.backends.k",
        "core->apps: qpass.other -> qpass.apps.app",
        "runtime->passes: qpass.runtime.sync -> qpass.passes.lower",
        "backends->apps: qpass.backends.k -> qpass.apps.app",
        "cycle: qpass.a <-> qpass.b",
        "cycle: qpass.apps.app <-> qpass.backends.k <-> qpass.core",
        "moved: qpass.apps.user -> qpass.backends.old (import qpass.apps.new)",
    ]), bad
    # the shim's alias edge is exempt only as an alias: without the table it is a plain backends -> apps edge
    assert "backends->apps: qpass.backends.old -> qpass.apps.new" in im.violations(g)
    # an allow-listed edge leaves the graph; everything else is still checked
    rest = im.violations(g, {("qpass.core", "qpass.backends.k")}, aliases)
    assert len(rest) == len(bad) - 1 and not any(r.startswith("core->backends") for r in rest)


def test_a_shim_naming_another_module_is_rejected(tmp_path):
    im = _import_map()
    _write(tmp_path, {"__init__.py": "", "a.py": "moved(__name__, 'qpass.b', 'qpass.c')\n"})
    import pytest

    with pytest.raises(ValueError, match="must name its own module 'qpass.a'"):
        im.moved_aliases(tmp_path)
