"""The old paths of the Triton tooling moved to ``qpass.apps.bench`` (issue 33) still work: importing
one gives the new module itself, and ``python -m <old path>`` runs the new module as ``__main__``
(the GPU scripts and older docs call them so)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qpass._moved import moved
from tests.test_import_map import OLD_TRITON_TOOLING

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
OLD_TO_NEW = OLD_TRITON_TOOLING  # one table of old -> new paths (tests/test_import_map.py)


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_old_path_is_the_new_module(old):
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {OLD_TO_NEW[old]}"):
        sys.modules.pop(old, None)
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(OLD_TO_NEW[old])
    assert sys.modules[old] is mod


def _run_m(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, timeout=300)


def test_python_m_selfcheck_runs_the_new_main(tmp_path):
    out = tmp_path / "sc.json"
    r = _run_m("qpass.backends.triton.selfcheck", "--quick", "--out", str(out))
    # on a machine without CUDA the self-check's own main answers: exit 2, nothing written
    assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (2, "selfcheck needs a CUDA device"), r.stderr
    assert not out.exists()


def test_python_m_bench_is_qpass_bench():
    r = _run_m("qpass.backends.triton.bench", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: qpass bench "), r.stdout + r.stderr
    bad = _run_m("qpass.backends.triton.bench", "--budget-s", "-1")
    assert bad.returncode == 2 and "--budget-s" in bad.stderr, bad.stderr


def test_moved_rejects_a_shim_naming_another_module():
    with pytest.raises(ValueError, match="shim 'qpass.x' declares old path 'qpass.y'"):
        moved("qpass.x", "qpass.y", "qpass.z")


def test_old_devcheck_tables_path_runs_the_new_module_with_its_exit_status(tmp_path):
    r = _run_m("qpass.backends.cuda.devcheck_tables", str(tmp_path))
    assert r.returncode == 2 and "no devcheck.json or e2e.json" in r.stderr, r.stderr
