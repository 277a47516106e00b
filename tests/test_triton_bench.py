"""``qpass bench``: the CPU modes run end to end and write their JSON + markdown atomically; the
quick run draws fixed inputs and does not depend on what was loaded before it; without triton the
command exits 2 with the install hint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from qpass.apps.cli import main as cli_main
from qpass.apps.bench import triton_bench as bench

_SRC = str(Path(bench.__file__).resolve().parents[3])  # the tree under test, first on sys.path


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=600)


def test_bench_quick_cpu(tmp_path):
    """Through the CLI tree, with the shared flags (``--threads`` is applied, ``-v`` accepted)."""
    out = tmp_path / "b" / "bench.json"
    prev = torch.get_num_threads()
    try:
        assert cli_main(["bench", "--quick", "--out", str(out), "--threads", "1", "-v"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(prev)
    data = json.loads(out.read_text())
    assert data["rows"] and all(r["mode"] == "pass" for r in data["rows"]), data["errors"]
    assert data["meta"]["seed"] == 0  # fixed, not drawn from the OS
    assert out.with_suffix(".md").read_text().startswith("# qpass kernel benchmark")
    assert not list(out.parent.glob(".*.tmp"))  # no temp files left behind


def test_bench_quick_after_the_compiled_kernel_copy_was_loaded(tmp_path):
    """The flake of ``test_bench_quick_cpu`` in a full run ("RuntimeError: 0 active drivers"): an
    earlier test (``test_triton_aot``) loaded the compiled-mode kernel copy first; with absolute
    imports inside ``kernels/`` both copies shared one module set built in compiled mode, so the
    interpreter copy launched compiled kernels on a machine without a GPU. In a fresh process:
    compiled copy first, then the quick bench, which must pass with the same numbers."""
    out = tmp_path / "b.json"
    r = _python(f"""
        import sys, torch
        from qpass.backends.triton._loader import kernel_lib
        gpu, cpu = kernel_lib(torch.device("cuda")), kernel_lib(torch.device("cpu"))
        assert (bool(gpu.common.INTERP.value), bool(cpu.common.INTERP.value)) == (False, True)
        for name in ("common", "nvfp4_quant", "nvfp4_gemm", "rac", "fp8"):
            assert getattr(gpu, name) is not getattr(cpu, name), name
        assert "qpass.backends.triton.kernels" not in sys.modules  # never imported under its file name
        from qpass.apps.bench import main
        sys.exit(main(["--quick", "--out", {str(out)!r}]))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert all(r["mode"] == "pass" for r in data["rows"]), data["errors"]


def test_bench_without_triton_exits_2_with_the_install_hint():
    r = _python("""
        import sys
        sys.modules["triton"] = None  # what `import triton` sees when the package is not installed
        from qpass.apps.cli import build_parser, main
        sub = next(a for a in build_parser()._actions if a.dest == "command")
        assert "--threads" in sub.choices["bench"].format_help()  # the CLI tree builds without triton
        sys.exit(main(["bench", "--quick"]))
    """)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert 'pip install -e ".[triton]"' in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_bench_full_code_path_smoke_cpu(tmp_path, monkeypatch):
    """The full-benchmark code path (sections, contenders, ratios, targets) at toy sizes on CPU."""
    out = tmp_path / "smoke.json"
    # the end-to-end section with its first point only (one toy model at B = 1, every recipe): every point
    # and batch size is covered by tests/test_bench_e2e.py; here only its place in the full run is checked
    plan = bench.e2e_plan
    monkeypatch.setattr(bench, "e2e_plan", lambda smoke: plan(smoke)[:1])
    # budget far beyond the run: on a busy machine a 120 s budget skipped rows (wall clock, not a property of the code)
    assert bench.run(bench.BenchOptions(smoke=True, out=str(out), budget_s=3600)) == 0
    data = json.loads(out.read_text())
    names = {r["name"] for r in data["rows"]}
    assert {"bf16 cuBLAS", "w4a16 triton", "w4a4 triton", "w4a4+RAC50 gathered/batch triton",
            "act quant + RAC 50% gathered/batch"} <= names
    assert not data["errors"], data["errors"]
    assert any(t["name"].startswith("RAC overhead") for t in data["targets"])
    rows = [r for r in data["rows"] if r["name"] == "w4a4 triton" and r["vs_bf16"] is not None]
    assert rows and all(r["time_us"] > 0 for r in rows)
    # the 4-bit peer (torch tinygemm INT4 g128; its CPU twin here) is timed where K % 128 == 0, with its
    # own error against its dequantized weight recorded (bf16 output rounding: ~3e-3), n/a elsewhere
    peer = [r for r in data["rows"] if r["name"].startswith("int4 tinygemm")]
    assert {r["k"] for r in peer if r["time_us"]} == {128} and all(r["mode"].startswith("n/a") for r in peer if r["k"] == 96)
    assert all(0 < r["extra"]["rel_err_vs_own_dequant"] < 1e-2 and r["vs_bf16"] for r in peer if r["time_us"])
    assert any("vs the best 4-bit peer" in t["name"] for t in data["targets"])
    # the end-to-end decode section runs in the full run too (after the priority kernel steps)
    e2e = [r for r in data["rows"] if r["section"] == bench.E2E_SECTION]
    assert len(e2e) == 4 and all(r["time_us"] and r["extra"]["replay_equals_eager"] for r in e2e)
    sections = list(dict.fromkeys(r["section"] for r in data["rows"]))
    assert sections.index(bench.E2E_SECTION) > sections.index("prefill (Llama-8B shapes)")


def test_bench_gemv_only_smoke_cpu(tmp_path):
    """``--gemv-only``: just the decode M <= 4 grid, the GEMV and the GEMM path side by side."""
    out = tmp_path / "gemv.json"
    assert bench.run(bench.BenchOptions(smoke=True, out=str(out), budget_s=3600, gemv_only=True)) == 0
    data = json.loads(out.read_text())
    assert not data["errors"], data["errors"]
    rows = data["rows"]
    assert {r["m"] for r in rows} == {1, 4}
    assert {"w4a16 triton [gemv]", "w4a16 triton [gemm]", "w4a4 triton [gemv]", "bf16 cuBLAS"} <= {r["name"] for r in rows}
    assert {r["section"] for r in rows} == {"decode (Llama-8B shapes)", "SmolLM2-135M shapes"}
    assert all(r["time_us"] for r in rows if "triton" in r["name"])
    assert any(t["name"].startswith("w4a16 triton [gemv] / gemm path") for t in data["targets"])
