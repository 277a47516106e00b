"""Packaging: the built wheel carries every module and recipe, and its Triton kernels import and run
from a fresh virtual environment (``packaging`` tier, part of the default run).

Guards the old defect where a hand-kept package list left ``qpass/backends/triton/kernels/`` out of
the wheel while the editable install of the test environment hid it.

How (offline, no build isolation): the git-tracked files are copied to a temp dir (so the build
leaves no ``build/`` or ``*.egg-info`` in the checkout), ``pip wheel --no-deps --no-build-isolation
--no-index`` builds the wheel there, a ``python -m venv --without-pip`` venv gets a ``.pth`` line
naming this interpreter's site-packages (torch, triton, ... come from there; ``.pth`` files *inside*
that directory are not processed, so the editable qpass install stays invisible) and the wheel is
installed with ``pip install --no-deps --target`` into the venv's site-packages (``--target`` never
touches packages installed elsewhere). A script then runs in the venv from a temp cwd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]

# runs inside the fresh venv: prints one JSON line
_PROBE = textwrap.dedent(
    """
    import importlib, json, os, pkgutil, sys
    import torch
    import qpass
    import qpass.backends.triton.kernels as kpkg
    kernels = []
    for m in pkgutil.iter_modules(kpkg.__path__):
        importlib.import_module(f"qpass.backends.triton.kernels.{m.name}")
        kernels.append(m.name)
    from qpass.backends.triton._loader import kernel_lib
    from qpass.backends.triton.quantize import nvfp4_quantize_triton
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 64, generator=g) * torch.exp(torch.randn(64, generator=g))).to(torch.bfloat16)
    x[0, :16] = 0.0
    ref, got = qpass.nvfp4_quantize(x), nvfp4_quantize_triton(x)
    same = {
        "codes": torch.equal(got.codes, ref.codes),
        "scales": torch.equal(got.scales.view(torch.uint8), ref.scales.view(torch.uint8)),
        "s_dec": torch.equal(got.s_dec.view(torch.int32), ref.s_dec.view(torch.int32)),
    }
    print(json.dumps({"qpass": qpass.__file__, "kernels_pkg": kpkg.__file__, "kernels": kernels,
                      "lib": kernel_lib(x.device).__file__, "same": same, "sys_path": sys.path}))
    """
)


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the wheel's expected contents come from git ls-files)")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f]


def _site_dirs() -> list[str]:
    dirs = []
    for key in ("purelib", "platlib"):
        d = sysconfig.get_paths()[key]
        if d not in dirs:
            dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tracked = _tracked_files()
    src = tmp_path_factory.mktemp("wheel_src")
    for rel in tracked:
        p = ROOT / rel
        if not p.exists() and not p.is_symlink():  # deleted in the work tree, not yet committed
            continue
        dst = src / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink():
            os.symlink(os.readlink(p), dst)
        else:
            shutil.copy2(p, dst)
    dist = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(dist), str(src)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    wheels = list(dist.glob("qpass-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contains_every_module_and_recipe(wheel):
    expected = {f[len("src/"):] for f in _tracked_files() if f.startswith("src/qpass/") and f.endswith((".py", ".yaml"))
                and (ROOT / f).exists()}
    assert "qpass/backends/triton/kernels/nvfp4_quant.py" in expected  # the file the old wheel lacked
    assert any(f.startswith("qpass/recipes/") for f in expected)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected - names)
    assert not missing, f"{wheel.name} lacks {len(missing)} tracked file(s): {missing[:20]}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "qpass = qpass.apps.cli:main" in text and "qpass_nvfp4 = qpass.backends.sglang:register" in text


def test_wheel_kernels_import_and_run_in_a_fresh_venv(wheel, tmp_path):
    pytest.importorskip("triton")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    assert site.is_relative_to(venv)
    (site / "_qpass_test_parent_env.pth").write_text("".join(d + "\n" for d in _site_dirs()))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "-q",
                        "--target", str(site), str(wheel)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"pip install failed:\n{r.stdout}\n{r.stderr}"
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    r = subprocess.run([str(py), "-c", _PROBE], cwd=run_dir, capture_output=True, text=True,
                       env=env | {"TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, f"probe failed in the fresh venv:\n{r.stdout}\n{r.stderr}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # the qpass that ran is the wheel's copy in the new venv, not the editable checkout
    for key in ("qpass", "kernels_pkg", "lib"):
        assert Path(res[key]).resolve().is_relative_to(site.resolve()), (key, res[key], res["sys_path"])
    assert {"nvfp4_quant", "nvfp4_gemm", "amax", "fp8", "mxfp4", "rac"} <= set(res["kernels"])
    assert res["same"] == {"codes": True, "scales": True, "s_dec": True}
