"""The GPU self-check module at toy sizes on the CPU interpreter: every check runs and passes, and a
GEMM that is off by one part in 1e4 is reported as a failure (the check can fail)."""

from __future__ import annotations

import pytest
import torch

import qpass.backends.triton as qt
from qpass.apps.bench.triton_selfcheck import Report, checks


def test_selfcheck_tiny_passes_on_the_interpreter():
    torch.manual_seed(0)  # fixed inputs: the same draw alone and in a full run
    rep = Report()
    checks(rep, torch.device("cpu"), big=64, tiny=True)
    names = [i["name"] for i in rep.items]
    assert len(names) == 22 and any("RAC" in n and "GEMM" in n for n in names), names  # no CUDA-graph check on CPU
    failed = [(i["name"], i["detail"]) for i in rep.items if not i["ok"]]
    assert not failed, failed


def test_selfcheck_reports_a_gemm_error(monkeypatch):
    real = qt.w4a4_linear_triton

    def off_by_1e4(*args, **kwargs):
        y = real(*args, **kwargs)
        return y * (1 + 1e-4)

    class GemmChecksOnly(Report):
        """Runs only the GEMM checks (the quantizer, RAC and decode checks pass in the test above and
        do not call the patched kernel; skipping them halves this test's CPU time)."""

        def run(self, name, fn):
            if "GEMM" in name:
                super().run(name, fn)

    monkeypatch.setattr(qt, "w4a4_linear_triton", off_by_1e4)
    torch.manual_seed(0)
    rep = GemmChecksOnly()
    checks(rep, torch.device("cpu"), big=64, tiny=True)
    by_name = {i["name"]: i for i in rep.items}
    gemm = [i for n, i in by_name.items() if n.startswith("W4A4 (+RAC) GEMM")]
    assert len(gemm) == 3 and not any(i["ok"] for i in gemm)
    assert "max rel err 1.00e-04" in gemm[0]["detail"]
    assert by_name["W4A16 bf16 GEMM N=K=64 vs fp64"]["ok"]
    assert set(by_name) == {"W4A16 bf16 GEMM N=K=64 vs fp64", *(i["name"] for i in gemm)}


def test_only_selects_checks_by_any_of_several_substrings():
    """``--only 'A;B'`` runs exactly the checks whose name contains A or B (a device call can run the
    checks another call did not reach)."""
    rep = Report(only="FP8 block;CUDA graph")
    for name in ("W4A4 GEMM", "FP8 block W8A8 paths", "CUDA graph capture (M=16)", "ops dispatch"):
        rep.run(name, lambda: (True, "ok"))
    assert [c["name"] for c in rep.items] == ["FP8 block W8A8 paths", "CUDA graph capture (M=16)"]
    assert [c["name"] for c in Report(only=None).items] == []


def test_out_naming_a_directory_exits_2_before_any_check(tmp_path, capsys):
    """``--out`` is the report's file path; a directory there was found only after the first check ran,
    as an IsADirectoryError traceback from the atomic write (on an H100, 2026-12-07)."""
    from qpass.apps.bench import triton_selfcheck as selfcheck

    with pytest.raises(SystemExit) as e:
        selfcheck.main(["--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} is a directory" in err and "selfcheck.json" in err
