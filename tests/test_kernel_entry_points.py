"""Every Triton kernel entry point has one named host launcher that a grep finds (issue 33).

The kernels package is loaded by file path, once per execution mode
(:mod:`qpass.backends.triton._loader`), so no ``import`` statement leads to it. The hop is instead
``kernel_lib(device).<module>.<launcher>(...)``: each ``@triton.jit`` function launched with a grid
(``_k[grid](...)``) is launched only from public module-level functions of its own file, and every
launcher name is called as an attribute (``.launch_x(``) from host code outside ``kernels/``.
Checked with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "qpass"
KERNELS = SRC / "backends" / "triton" / "kernels"
HOST = [*sorted((SRC / "backends" / "triton").glob("*.py")), *sorted((SRC / "apps" / "bench").glob("*.py"))]
TEST_ONLY = {"probe": Path(__file__).with_name("test_triton_quant.py")}  # bit-level probes of common.py helpers


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def launches() -> dict[tuple[str, str], set[str]]:
    """``{(file stem, jit kernel): {top-level functions that launch it with a grid, or hand it to a
    ``launch_*`` dispatch helper as its first argument}}``."""
    out: dict[tuple[str, str], set[str]] = {}
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        jit = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)}
        jit |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names
                if a.name.endswith("_kernel")}  # kernels imported from a sibling (the split-K reduce)
        for top in tree.body:
            for node in ast.walk(top):
                if not isinstance(node, ast.Call):
                    continue
                owner = top.name if isinstance(top, ast.FunctionDef) else "<module>"
                if isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name) \
                        and node.func.value.id in jit:
                    out.setdefault((path.stem, node.func.value.id), set()).add(owner)
                # a launcher handing its kernel to a shared grid-dispatch helper (launch_row_tiled(k, ...))
                elif isinstance(node.func, ast.Name) and node.args and isinstance(node.args[0], ast.Name) \
                        and node.args[0].id in jit and node.func.id.startswith("launch_"):
                    out.setdefault((path.stem, node.args[0].id), set()).add(owner)
    return out


def test_every_launched_kernel_has_public_launchers_in_its_file():
    got = launches()
    assert len(got) >= 15
    bad = {k: v for k, v in got.items() if any(o == "<module>" or o.startswith("_") for o in v)}
    assert bad == {}


def test_every_kernel_named_x_kernel_is_launched():
    launched = {name for _, name in launches()}
    defined = {(p.stem, n.name) for p in KERNELS.glob("*.py") for n in ast.parse(p.read_text()).body
               if isinstance(n, ast.FunctionDef) and _is_jit(n) and n.name.endswith("_kernel")}
    assert sorted(d for d in defined if d[1] not in launched) == []


def test_every_launcher_is_called_by_name_from_host_code():
    launchers = {o for owners in launches().values() for o in owners}
    assert set(TEST_ONLY) <= launchers
    host = "\n".join(p.read_text() for p in HOST)
    uncalled = sorted(name for name in launchers - set(TEST_ONLY) if not re.search(rf"\.{name}\(", host))
    assert uncalled == []
    for name, test in TEST_ONLY.items():  # called from its test only (kernel_lib("cpu").probe.probe)
        assert re.search(rf"\.{name}\.{name}\b", test.read_text()) and not re.search(rf"\.{name}\(", host), name
