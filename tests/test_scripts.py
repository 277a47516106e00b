"""scripts/ holds commands and lab files only (scripts/README.md): every file has a README row, nothing
edits ``sys.path``, the commands run (a tiny CPU case or ``--help``), every qpass name a Python
script imports exists, the shell launchers parse (``bash -n``), and the GPU-box entry point
``scripts/gpu.sh`` lists, dispatches and refuses its subcommands (run here with stub bodies: no GPU)."""

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
WITH_CLI = [f for f in PY if "argparse" in (SCRIPTS / f).read_text() or "vllm_cli(" in (SCRIPTS / f).read_text()]


def test_readme_has_one_row_per_file():
    rows = re.findall(r"^\| `([^`]+)` \|", (SCRIPTS / "README.md").read_text(), flags=re.M)
    assert sorted(rows) == FILES
    assert len(FILES) == 45 and len(SH) == 23


def test_nothing_edits_sys_path():
    hits = [f for f in FILES if re.search(r"sys\.path\.(insert|append)\(", (SCRIPTS / f).read_text())]
    assert hits == []


def test_every_lab_file_states_its_provenance():
    readme = (SCRIPTS / "README.md").read_text()
    lab = re.findall(r"^\| `([^`]+)` \| lab (?:file|launcher)", readme, flags=re.M)
    assert len(lab) == 25
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


# --- scripts/gpu.sh: the one GPU-box entry point (stub bodies stand in for the GPU work)

GPU_SUBCOMMANDS = ["kernels", "gemv", "moe", "grpo", "grpo-long", "long-jobs", "megatron", "study", "vllm-linear", "cuda", "bf16-gap"]
WRAPPERS = {"gpu_kernels.sh": "kernels", "gpu_gemv.sh": "gemv", "gpu_moe.sh": "moe", "gpu_grpo.sh": "grpo",
            "gpu_grpo_long.sh": "grpo-long", "gpu_long_jobs.sh": "long-jobs", "gpu_megatron.sh": "megatron",
            "gpu_study.sh": "study", "gpu_vllm_linear.sh": "vllm-linear", "probes/bf16_gap_probe.sh": "bf16-gap"}
HELP_ROW = re.compile(r"^  (\S+) +(.+?)  \[scripts/gpu/(\S+)\.sh; (.+)\]$")


def _gpu(*argv: str, cwd: Path = ROOT, script: Path = SCRIPTS / "gpu.sh") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *argv], cwd=cwd, capture_output=True, text=True, timeout=60)


def _help_rows() -> list[tuple[str, str, str, list[str]]]:
    r = _gpu("--help")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith("usage: [KNOB=value ...] bash scripts/gpu.sh SUBCOMMAND [ARGS]")
    rows = [m.groups() for m in map(HELP_ROW.match, r.stdout.splitlines()) if m]
    return [(name, what, body, mods.split()) for name, what, body, mods in rows]


def test_gpu_help_lists_every_subcommand_once():
    assert [name for name, *_ in _help_rows()] == GPU_SUBCOMMANDS
    for flag in ("-h", "help"):
        assert _gpu(flag).stdout == _gpu("--help").stdout


def test_every_gpu_body_has_one_subcommand_and_runs_existing_modules():
    rows = _help_rows()
    bodies = sorted(f"{b}.sh" for _, _, b, _ in rows)
    assert bodies == sorted(p.name for p in (SCRIPTS / "gpu").glob("*.sh"))
    for name, _, body, mods in rows:
        assert body == name.replace("-", "_")
        text = (SCRIPTS / "gpu" / f"{body}.sh").read_text()
        assert f"# Body of `bash scripts/gpu.sh {name}`" in text
        for mod in mods:  # named by the body; a scripts/ file, or a module file of the source tree (not imported: no triton)
            rel = Path(mod) if "/" in mod else Path("src", *mod.split("."))
            found = (ROOT / rel).is_file() or (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()
            assert mod in text and found, (name, mod)


@pytest.mark.parametrize("argv,message", [(("nope",), "gpu.sh: unknown subcommand 'nope' (one of: " + " ".join(GPU_SUBCOMMANDS) + ")\n"),
                                          ((), "gpu.sh: missing SUBCOMMAND\n")])
def test_gpu_refuses_a_missing_or_unknown_subcommand_with_exit_2(argv, message):
    r = _gpu(*argv)
    assert r.returncode == 2 and r.stdout == "" and message in r.stderr


def _stub_repo(tmp_path: Path) -> Path:
    """A repository root whose gpu/*.sh bodies only report what gpu.sh gave them (arguments, gpu_open's effects)."""
    (tmp_path / "scripts" / "gpu").mkdir(parents=True)
    (tmp_path / "scripts" / "gpu.sh").write_text((SCRIPTS / "gpu.sh").read_text())
    for sub in GPU_SUBCOMMANDS:
        (tmp_path / "scripts" / "gpu" / f"{sub.replace('-', '_')}.sh").write_text(
            f'gpu_open\necho "{sub} args=$*; OUT=${{OUT#$REPO/}}; strict=$(set -o | grep -c "nounset.*on")"\nexit 7\n')
    return tmp_path


def test_gpu_sources_the_subcommands_body_with_its_arguments(tmp_path):
    repo = _stub_repo(tmp_path)
    r = _gpu("grpo-long", "speed", "x y", cwd=repo, script=repo / "scripts" / "gpu.sh")
    assert (r.returncode, r.stdout, r.stderr) == (7, "grpo-long args=speed x y; OUT=gpu_out; strict=1\n", "")
    assert (repo / "gpu_out").is_dir()


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_every_old_launcher_path_is_a_one_line_wrapper(wrapper, tmp_path):
    sub = WRAPPERS[wrapper]
    lines = [ln for ln in (SCRIPTS / wrapper).read_text().splitlines() if not ln.startswith("#")]
    assert lines == [f'exec bash "$(pwd)/scripts/gpu.sh" {sub} "$@"']
    repo = _stub_repo(tmp_path)
    r = _gpu("a", cwd=repo, script=SCRIPTS / wrapper)
    assert (r.returncode, r.stdout) == (7, f"{sub} args=a; OUT=gpu_out; strict=1\n")


def _summary(*argv: str, monkeypatch) -> tuple[object, list[str]]:
    code, out = _run("gpu_summary.py", *argv, monkeypatch=monkeypatch)
    return code, out.splitlines()


def test_gpu_summary_of_a_moe_run(tmp_path, monkeypatch):
    (tmp_path / "moe_check.json").write_text(json.dumps({
        "ok": False, "complete": False, "wall_s": 3, "device": "H200",
        "checks": [{"name": "bits", "ok": True, "detail": "a|b\nsecond line"}, {"name": "rel", "ok": False, "detail": ""}],
        "timing": [{"shape": "s", "T": 16, "skipped": "budget"},
                   {"shape": "s", "T": 512, "rows": 4096, "N": 2048, "K": 1024, "case": "grouped", "ms": 0.25}]}))
    code, lines = _summary("moe", str(tmp_path), "1", str(2**40), monkeypatch=monkeypatch)
    assert code is None
    assert lines[:12] == ["# qpass grouped experts GEMM on the GPU: summary", "",
                          "## checks: FAILURES -- INCOMPLETE (rc=1, 3 s, H200)", "",
                          "| check | result | detail |", "| --- | --- | --- |",
                          "| bits | PASS | a|b |", "| rel | **FAIL** |  |", "",
                          "| shape | T | rows | N | K | case | ms |", "| --- | --- | --- | --- | --- | --- | --- |",
                          "| s | 16 | - | - | - | skipped (budget) | - |"]
    assert lines[12:14] == ["| s | 512 | 4096 | 2048 | 1024 | grouped | 0.25 |", ""]
    assert re.fullmatch(rf"total wall time -\d+ s; files in {re.escape(str(tmp_path))}", lines[14]) and len(lines) == 15


def test_gpu_summary_of_a_kernels_run(tmp_path, monkeypatch):
    (tmp_path / "selfcheck.json").write_text(json.dumps({
        "ok": True, "seed": 0, "wall_s": 12.5, "checks": [{"name": "gemm", "ok": True, "detail": "x|y"}]}))
    # bench.json missing: the benchmark part becomes a NO REPORT line, the summary still prints
    code, lines = _summary("kernels", str(tmp_path), "0", "124", str(2**40), monkeypatch=monkeypatch)
    assert code is None
    assert lines[:8] == ["# qpass GPU kernel run: summary", "", "## correctness: ALL PASS (rc=0, seed 0, 12.5 s)", "",
                         "| check | result | detail |", "| --- | --- | --- |", "| gemm | PASS | x/y |", ""]
    assert lines[8].startswith("## benchmark: NO REPORT (rc=124): FileNotFoundError: ")


def test_gpu_summary_refuses_bad_arguments_with_exit_2(monkeypatch):
    code, _ = _summary("kernels", "OUT", "0", monkeypatch=monkeypatch)
    assert code == 2
