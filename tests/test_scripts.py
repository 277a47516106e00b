"""scripts/ holds commands and lab files only (scripts/README.md): every file has a README row, nothing
edits ``sys.path``, the commands run (a tiny CPU case or ``--help``), every qpass name a Python
script imports exists, and the shell launchers parse (``bash -n``)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
FILES = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*") if p.is_file() and p.name != "README.md"
               and "__pycache__" not in p.parts)
PY = [f for f in FILES if f.endswith(".py")]
SH = [f for f in FILES if f.endswith(".sh")]
WITH_CLI = [f for f in PY if "argparse" in (SCRIPTS / f).read_text()]


def test_readme_has_one_row_per_file():
    rows = re.findall(r"^\| `([^`]+)` \|", (SCRIPTS / "README.md").read_text(), flags=re.M)
    assert sorted(rows) == FILES
    assert len(FILES) == 33 and len(SH) == 12


def test_nothing_edits_sys_path():
    hits = [f for f in FILES if re.search(r"sys\.path\.(insert|append)\(", (SCRIPTS / f).read_text())]
    assert hits == []


def test_every_lab_file_states_its_provenance():
    readme = (SCRIPTS / "README.md").read_text()
    lab = re.findall(r"^\| `([^`]+)` \| lab (?:file|launcher)", readme, flags=re.M)
    assert len(lab) == 24
    assert [f for f in lab if "Provenance (lab" not in (SCRIPTS / f).read_text()[:3000]] == []


def _qpass_imports(path: Path) -> list[tuple[str, str | None]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "qpass"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "qpass":
            out += [(node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("script", PY)
def test_every_qpass_name_a_script_imports_exists(script):
    pytest.importorskip("triton")
    missing = []
    for mod, name in _qpass_imports(SCRIPTS / script):
        if importlib.util.find_spec(mod) is None:
            missing.append(mod)
        elif name is not None:
            m = importlib.import_module(mod)
            if not hasattr(m, name) and not (hasattr(m, "__path__") and importlib.util.find_spec(f"{mod}.{name}")):
                missing.append(f"{mod}.{name}")
    assert missing == []


@pytest.mark.parametrize("script", WITH_CLI)
def test_help_runs(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / script), "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    assert exc.value.code == 0 and out.getvalue().startswith("usage: ")


@pytest.mark.parametrize("script", SH)
def test_launcher_parses(script):
    r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (0, "")


def _run(script: str, *argv: str, monkeypatch) -> tuple[object, str]:
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / script), *argv])
    out = io.StringIO()
    code = None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(str(SCRIPTS / script), run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue()


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_import_map_command_exits_0(monkeypatch):
    code, out = _run("import_map.py", monkeypatch=monkeypatch)
    assert code == 0 and out.rstrip().endswith("0 violation(s)")


def test_grpo_long_summary_on_a_tiny_run(tmp_path, monkeypatch):
    run = tmp_path / "r1"
    run.mkdir()
    # 12 steps, reward i/8: first 10 mean 45/80, last 10 mean 65/80; gaps alternate 0.5 / 0.25
    _jsonl(run / "metrics.jsonl", [{"step": i + 1, "reward/mean": i / 8, "gap/token/g_abs": 0.5 if i % 2 else 0.25,
                                    "gap/max_abs": 2.0} for i in range(12)])
    _jsonl(run / "eval.jsonl", [{"step": 0, "eval/accuracy": 0.5, "eval/stderr": 0.1},
                                {"step": 12, "eval/accuracy": 0.625, "eval/stderr": 0.125}])
    (run / "summary.json").write_text('{"stop_reason": "steps"}')
    code, out = _run("grpo_long_summary.py", str(tmp_path / "t.md"), str(run), monkeypatch=monkeypatch)
    assert code is None
    row = json.loads((tmp_path / "t.json").read_text())["r1"]
    assert {k: row[k] for k in ("steps", "stop", "reward_first10", "reward_last10", "eval_step0", "eval_best",
                                "eval_last", "eval_last_stderr", "g_abs", "max_abs", "shadow_g_abs")} == {
        "steps": 12, "stop": "steps", "reward_first10": 0.5625, "reward_last10": 0.8125, "eval_step0": 0.5,
        "eval_best": 0.625, "eval_last": 0.625, "eval_last_stderr": 0.125, "g_abs": 0.375, "max_abs": 2.0,
        "shadow_g_abs": None}
    assert row["collapse"]["collapsed"] is False
    assert "| r1 | 12 | steps | 0.5625 -> 0.8125 | 0.5 / 0.625 / 0.625 (+-0.125) | 0.375 | 2 | n/a |" in out


def test_moe_apply_summary_on_a_tiny_apply_output(tmp_path, monkeypatch):
    sites = {}
    for e in (0, 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            s = f"model.layers.0.mlp.experts.{e}.{proj}"
            group = s.rsplit(".", 1)[0] + ".gate_up" if proj != "down_proj" else s
            sites[s] = {"group": group, "kind": "nvfp4_linear", "act_spec": "nvfp4"}
    sites["model.layers.0.self_attn.q_proj"] = {"group": "qkv", "kind": "nvfp4_linear", "act_spec": None}
    q = {"sites": sites, "rac": {"model.layers.0.mlp.experts.0.gate_proj": {}, "model.layers.0.mlp.experts.0.up_proj": {}},
         "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"]}
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "hf_quant_config.json").write_text(json.dumps({"quantization": q}))
    rep = {"model": {"name": "moe-tiny"}, "recipe": {"name": "quads_nvfp4_moe"}, "kernels_effective": "reference",
           "sites": {"total": 8, "rollout_w4a4": 6, "learner_qdq": 7}, "timings": {"apply": 1.5}, "ok": True,
           "parity": {"structural_ok": True, "weights_bitexact": True, "checks": 5, "mismatched_groups": []}}
    (tmp_path / "report.json").write_text(json.dumps(rep))
    code, out = _run("moe_apply_summary.py", str(tmp_path), monkeypatch=monkeypatch)
    assert code == 0
    got = json.loads(out)
    assert {k: got[k] for k in ("expert_sites", "moe_layers", "experts_per_layer", "expert_sites_expected",
                                "expert_groups", "w13_groups_fuse_gate_and_up", "expert_sites_all_nvfp4_w4a4",
                                "rac_sites", "rac_sites_are_w13", "routers_excluded", "routers_excluded_count",
                                "logprob_gap", "ok")} == {
        "expert_sites": 6, "moe_layers": 1, "experts_per_layer": 2, "expert_sites_expected": 6, "expert_groups": 4,
        "w13_groups_fuse_gate_and_up": True, "expert_sites_all_nvfp4_w4a4": True, "rac_sites": 2,
        "rac_sites_are_w13": True, "routers_excluded": ["model.layers.0.mlp.gate", "..."],
        "routers_excluded_count": 1, "logprob_gap": None, "ok": True}
