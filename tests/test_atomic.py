"""The one atomic writer (files and output directories) and the one JSON writer (no NaN in JSON)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from qpass.atomic import OutputBusy, atomic_dir
from qpass.errors import QpassError


def _strict_load(text: str):
    def no_constants(name):
        raise AssertionError(f"{name} in JSON")

    return json.loads(text, parse_constant=no_constants)


# ----------------------------------------------------------------------------- output directories


def test_dir_that_appears_during_the_run_is_never_deleted(tmp_path):
    """Old code: the later writer renamed the other run's finished DIR aside and deleted it (exit 0)."""
    out = tmp_path / "o"
    with pytest.raises(OutputBusy, match="appeared while this run was writing it"):
        with atomic_dir(out) as tmp:
            (tmp / "report.json").write_text("mine")
            out.mkdir()  # another run finished first
            (out / "report.json").write_text("theirs")
    assert (out / "report.json").read_text() == "theirs"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("o.unplaced-")]
    assert len(kept) == 1 and (kept[0] / "report.json").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir, no lock left


def test_force_refuses_a_dir_replaced_during_the_run(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.json").write_text("old")
    with pytest.raises(OutputBusy, match="was replaced"):
        with atomic_dir(out, force=True) as tmp:
            (tmp / "report.json").write_text("mine")
            os.rename(out, tmp_path / "elsewhere")
            out.mkdir()
            (out / "report.json").write_text("theirs")
    assert (out / "report.json").read_text() == "theirs"


def test_second_writer_of_the_same_dir_fails_at_the_start(tmp_path):
    out = tmp_path / "o"
    with atomic_dir(out) as tmp:
        (tmp / "f").write_text("1")
        with pytest.raises(OutputBusy, match=rf"being written by another run \(pid {os.getpid()}"):
            with atomic_dir(out):
                raise AssertionError("the second writer must not start")
    assert (out / "f").read_text() == "1"
    with atomic_dir(out, force=True, marker="f") as tmp:  # the reservation was released
        (tmp / "f").write_text("2")
    assert (out / "f").read_text() == "2"


def test_two_processes_one_output(tmp_path):
    """A live process holds DIR's reservation: a second writer fails at once; a dead holder's lock is stale."""
    out = tmp_path / "o"
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import time, pathlib
        from qpass.atomic import atomic_dir
        with atomic_dir(pathlib.Path({str(out)!r})) as tmp:
            (tmp / "report.json").write_text("first")
            pathlib.Path({str(ready)!r}).write_text("")
            time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists()
        with pytest.raises(OutputBusy, match=f"pid {proc.pid}"):
            with atomic_dir(out):
                pass
    finally:
        proc.kill()
        proc.wait()
    # SIGKILLed holder: its lock names a dead pid, so the next writer takes over
    with atomic_dir(out) as tmp:
        (tmp / "report.json").write_text("second")
    assert (out / "report.json").read_text() == "second"


@pytest.mark.parametrize("dangling", [True, False])
def test_symlink_as_output_is_refused_before_any_work(tmp_path, dangling):
    """Old code: a dangling link ran the whole block, then the rename raised NotADirectoryError."""
    target = tmp_path / "target"
    if not dangling:
        target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    ran = []
    with pytest.raises(QpassError, match="symbolic link"):
        with atomic_dir(link, force=True):
            ran.append(1)
    assert ran == [] and link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["link"] + ([] if dangling else ["target"]))


def test_force_hint_never_suggests_a_force_that_would_refuse(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(QpassError) as e:
        with atomic_dir(mine):
            pass
    assert "choose another --out" in str(e.value) and "pass --force to replace it" not in str(e.value)
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "report.json").write_text("{}")
    with pytest.raises(QpassError, match=r"previous output, it holds report.json\); pass --force to replace it"):
        with atomic_dir(prev):
            pass
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(QpassError, match="is a file; choose another --out"):
        with atomic_dir(f, force=True):
            pass


def test_keep_partial_moves_the_temp_dir(tmp_path):
    out = tmp_path / "run"
    d = atomic_dir(out, keep_partial=True)
    with pytest.raises(KeyboardInterrupt):
        with d as tmp:
            (tmp / "m").write_text("1")
            raise KeyboardInterrupt
    assert d.kept == tmp_path / "run.partial" and (d.kept / "m").read_text() == "1" and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ----------------------------------------------------------------------------- JSON


def test_one_json_writer_writes_no_nan(tmp_path):
    """Old code: report.json (artifacts.write_json) wrote NaN tokens (allow_nan=True)."""
    from qpass.apps.artifacts import write_json

    data = {"a": float("nan"), "b": [1.0, float("inf"), 2.0], "c": {"d": -math.inf}, "t": torch.tensor([1.0, float("nan")]),
            "ok": 0.5, "p": Path("x/y"), "s": {3, 1}, "z": torch.tensor(2.0)}
    write_json(tmp_path / "r.json", data)
    got = _strict_load((tmp_path / "r.json").read_text())
    assert got == {"a": None, "a_reason": "non-finite: nan", "b": [1.0, None, 2.0], "b_reason": "non-finite: inf at [1]",
                   "c": {"d": None, "d_reason": "non-finite: -inf"}, "t": [1.0, None], "t_reason": "non-finite: nan at [1]",
                   "ok": 0.5, "p": "x/y", "s": [1, 3], "z": 2.0}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_every_json_writer_is_the_same_function():
    import qpass.apps.artifacts as artifacts
    import qpass.apps.grpo.jsonl as jsonl
    import qpass.jsonio as jsonio

    assert artifacts.write_json is jsonio.write_json and jsonl.write_json_atomic is jsonio.write_json
    assert jsonl.json_safe is jsonio.json_safe
