"""``qpass.provenance``: git commit + dirty flag, the env fallback where no .git exists, the source digest."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from qpass import provenance as pv

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@x", "HOME": str(cwd), "PATH": "/usr/bin:/bin"})


@needs_git
def test_git_commit_and_dirty_flag(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    st = pv.git_state(tmp_path)
    assert st == {"git_commit": head, "git_dirty": False, "dirty_files": [], "git_source": "git"}
    (tmp_path / "a.py").write_text("x = 2\n")
    st = pv.git_state(tmp_path)
    assert st["git_dirty"] is True and st["dirty_files"] == [" M a.py"]
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "new.py").write_text("")  # an untracked file is a change too
    assert pv.git_state(tmp_path)["dirty_files"] == ["?? new.py"]


def test_without_git_the_launcher_env_names_the_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("QPASS_SOURCE_COMMIT", raising=False)
    monkeypatch.delenv("QPASS_SOURCE_DIRTY", raising=False)
    assert pv.git_state(tmp_path) == {"git_commit": None, "git_dirty": None, "dirty_files": [], "git_source": "none"}
    monkeypatch.setenv("QPASS_SOURCE_COMMIT", "abc123")
    monkeypatch.setenv("QPASS_SOURCE_DIRTY", "0")
    assert pv.git_state(tmp_path) == {"git_commit": "abc123", "git_dirty": False, "dirty_files": [], "git_source": "env"}


def test_source_digest_sees_every_byte_and_path(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.py").write_text("x = 1\n")
    (tmp_path / "m" / "__pycache__").mkdir()
    (tmp_path / "m" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    d0 = pv.source_digest(tmp_path / "m")
    (tmp_path / "m" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"other")
    assert pv.source_digest(tmp_path / "m") == d0  # caches do not count
    (tmp_path / "m" / "a.py").write_text("x = 2\n")
    assert pv.source_digest(tmp_path / "m") != d0
    (tmp_path / "m" / "a.py").write_text("x = 1\n")
    assert pv.source_digest(tmp_path / "m") == d0
    (tmp_path / "m" / "a.py").rename(tmp_path / "m" / "b.py")
    assert pv.source_digest(tmp_path / "m") != d0


def test_collect_record_shape():
    rec = pv.collect(["study", "--out", "x y"], device="cpu", extra={"k": 1})
    assert rec["command"]["cmdline"] == "qpass study --out 'x y'"
    assert set(rec) == {"schema", "command", "code", "versions", "device", "host", "utc", "extra"}
    assert rec["extra"] == {"k": 1} and rec["device"]["type"] == "cpu"
    assert {"python", "torch", "triton", "transformers"} <= set(rec["versions"])
