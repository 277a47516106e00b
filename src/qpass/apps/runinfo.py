"""What ``qpass grpo`` and ``qpass study`` record about how a run was made (one place for both).

* ``--kernel-tiles pinned|autotune`` (:func:`add_kernel_tiles`; default ``pinned``): Triton launch
  tiles fixed per shape without timing, or autotuned (:mod:`qpass.backends.triton.tiles`);
  :func:`kernel_tiles_scope` applies it for the run, :func:`kernel_tiles_report` is what the run
  directory records (``kernel_tiles.json``: the mode and every tile used per kernel and shape key).
* :func:`provenance` / :func:`write_provenance`: :func:`qpass.provenance.collect` (command, code,
  versions, GPU and driver) plus the run's kernel settings, written as ``provenance.json``.

Reference kernels run no Triton code; the tile setting is then recorded but has nothing to choose.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["KERNEL_TILE_MODES", "add_kernel_tiles", "kernel_tiles_report", "kernel_tiles_scope", "provenance",
           "write_provenance"]

#: ``--kernel-tiles`` choices (equal to :data:`qpass.backends.triton.tiles.TILE_MODES`; kept here so the
#: parsers build without importing Triton).
KERNEL_TILE_MODES = ("pinned", "autotune")


def add_kernel_tiles(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--kernel-tiles pinned|autotune`` (default ``pinned``)."""
    ap.add_argument("--kernel-tiles", default="pinned", choices=KERNEL_TILE_MODES,
                    help="Triton launch tiles: pinned = a fixed documented tile per shape, chosen without timing (runs "
                         "repeat bit for bit on one card kind; default), autotune = timed on first use "
                         "(qpass.backends.triton.tiles)")


def _tiles_module() -> Any:
    try:
        from qpass.backends.triton import tiles
    except ImportError:  # no triton: only the reference kernels run, nothing to pin
        return None
    return tiles


@contextlib.contextmanager
def kernel_tiles_scope(mode: str) -> Iterator[None]:
    """Run the body with the Triton tile mode ``mode`` (restored afterwards; a no-op without Triton)."""
    tiles = _tiles_module()
    if tiles is None:
        yield
        return
    with tiles.tile_mode_scope(mode):
        yield


def kernel_tiles_report(mode: str, kernels: str) -> dict[str, Any]:
    """The JSON record of the tiles a run used: ``{"mode", "kernels", "pinned": {...}, "autotuned": {...}}``."""
    tiles = _tiles_module()
    if tiles is None:
        return {"mode": mode, "kernels": kernels, "pinned": {}, "autotuned": {}, "triton": False}
    with tiles.tile_mode_scope(mode):
        rep = tiles.report()
    return {**rep, "kernels": kernels, "triton": True}


def provenance(argv: Sequence[str], *, device: str, kernels: str, kernel_tiles: str,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`qpass.provenance.collect` with the run's kernel backend and tile mode in ``extra``."""
    from qpass.provenance import collect

    return collect(argv, device=device, extra={"kernels": kernels, "kernel_tiles": kernel_tiles, **dict(extra or {})})


def write_provenance(directory: str | Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` as ``directory/provenance.json`` (atomic, strict JSON). Returns the path."""
    from qpass.jsonio import write_json

    path = Path(directory) / "provenance.json"
    write_json(path, dict(record))
    return path
