"""Launch tiles of the Triton kernels: autotuned (chosen by timing) or pinned (a fixed rule per shape).

Why it matters: a tile is not only a speed choice. The NVFP4 GEMMs sum each K tile in the tensor
cores and add the partial into the float32 accumulator (two-level accumulation,
:mod:`.kernels.nvfp4_gemm`), and the GEMV reduces a ``BK``-wide tile per step, so two tiles with a
different ``BK`` round differently and give different logits. ``triton.autotune`` picks the tile by
timing each candidate on the first call of a shape; near-ties (e.g. ``BK`` 128 vs 256 of the
small-M GEMM on SmolLM2's 576-wide inputs: ``docs/results/h200/bench_e2e.json`` picked 128,
``bench_m128_routing.json`` 256 for the same key on the same card kind) flip with whatever else runs
on the GPU, so two processes of the same run can sample different tokens from the same weights.

Modes (:data:`TILE_MODES`):

* ``autotune`` (library default, ``qpass bench``): the autotuners of the kernel modules;
* ``pinned`` (``qpass grpo`` / ``qpass study`` default, ``--kernel-tiles``): every launcher that
  would autotune calls its kernel with the tile :data:`RULES` gives for the shape, chosen without
  timing; every choice is recorded (:func:`report`) and written into the run directory.

Process default: ``QPASS_TRITON_TILES=autotune|pinned`` (unset: ``autotune``); :func:`set_tile_mode`
/ :func:`tile_mode_scope` change it. Under the Triton interpreter (CPU tensors) the launchers keep
their own small fixed tiles in either mode. ``QPASS_NVFP4_GEMV_TILE`` (an explicit GEMV tile) still
wins over the rule.

The rules (each tile is one of its autotuner's candidates, so it compiles without spills where
those do; ``tests/test_tiles.py`` checks membership):

============== ===================================== ==================================================
kernel          key (what the tile may depend on)     pinned tile
============== ===================================== ==================================================
gemm_small      M <= 64 (128) rows, split-K launcher  BK 128, 4 stages, 4 warps (163 of 184 autotune
                                                      picks on the H200 raw files)
gemm_large      two-level accumulation                BN 64 x BM 128 x BK 64, 4 stages, 4 warps (the
                                                      most frequent pick); with the dense RAC operand
                                                      (SEG2 1) BN 64 x BM 64 x BK 64, 4 stages, 4 warps
                                                      (the only tiles its register prune keeps)
gemm_large      ``mma`` accumulation                  BN 128 x BM 128 x BK 64, 4 stages, 8 warps
gemv            no split                              BN 8 x BK 512, 4 warps
gemv_split      split-K (BN fixed to 8)               BK 512, 4 warps
fp8_gemm        M bucket <= 64 / larger               BM 64 x BN 64 (4 warps, 4 stages) / BM 128 x BN 128
                                                      (8 warps, 3 stages)
nvfp4_quant     M > 64 rows                           BM 16 x BK 128, 4 row iterations, 3 stages, 4 warps
rac_masked      M > 64 rows                           same as nvfp4_quant
============== ===================================== ==================================================

The quantization kernels' outputs do not depend on their tile (elementwise per 16-block, integer
atomics), the GEMMs' do; all are pinned so a run's launches are a function of its shapes only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["RULES", "TILE_MODES", "Tile", "pinned_tile", "report", "reset_record", "set_tile_mode", "tile_mode",
           "tile_mode_scope"]

#: Tile selection modes.
TILE_MODES = ("autotune", "pinned")
ENV = "QPASS_TRITON_TILES"


@dataclasses.dataclass(frozen=True)
class Tile:
    """One launch configuration: the kernel's tile meta-parameters plus ``num_warps`` / ``num_stages``."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int

    def kwargs(self) -> dict[str, int]:
        """Keyword arguments of the kernel launch (meta-parameters, ``num_warps``, ``num_stages``)."""
        return {**dict(self.meta), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def describe(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.meta) + f", num_warps: {self.num_warps}, num_stages: {self.num_stages}"


def _t(num_warps: int, num_stages: int, **meta: int) -> Tile:
    return Tile(tuple(meta.items()), num_warps, num_stages)


def _gemm_small(shape: Mapping[str, Any]) -> Tile:
    return _t(4, 4, BK=128, STAGES=4)


def _gemm_large(shape: Mapping[str, Any]) -> Tile:
    if shape.get("PROMOTE_K", 0):
        if shape.get("SEG2", 0) == 1:  # the two accumulations of SPEC §3.1 live: only 64 x 64 fits the registers
            return _t(4, 4, BN=64, BM=64, BK=64, STAGES=4)
        return _t(4, 4, BN=64, BM=128, BK=64, STAGES=4)
    return _t(8, 4, BN=128, BM=128, BK=64, STAGES=4)


def _gemv(shape: Mapping[str, Any]) -> Tile:
    return _t(4, 1, BN=8, BK=512)


def _gemv_split(shape: Mapping[str, Any]) -> Tile:
    return _t(4, 1, BK=512)


def _fp8(shape: Mapping[str, Any]) -> Tile:
    if int(shape["M_BUCKET"]) <= 64:
        return _t(4, 4, BM=64, BN=64)
    return _t(8, 3, BM=128, BN=128)


def _quant(shape: Mapping[str, Any]) -> Tile:
    return _t(4, 3, BM=16, BK=128, ROW_ITERS=4, STAGES=3)


#: Pinned tile per kernel name, as a function of the launch's shape key (see the module docstring).
RULES: dict[str, Callable[[Mapping[str, Any]], Tile]] = {
    "gemm_small": _gemm_small,
    "gemm_large": _gemm_large,
    "gemv": _gemv,
    "gemv_split": _gemv_split,
    "fp8_gemm": _fp8,
    "nvfp4_quant": _quant,
    "rac_masked": _quant,
}

_LOCK = threading.Lock()
_MODE: list[str | None] = [None]  # None: read the environment
_RECORD: dict[str, dict[str, str]] = {}


def _check(mode: str, what: str) -> str:
    if mode not in TILE_MODES:
        raise ValueError(f"{what} must be one of {list(TILE_MODES)}, got {mode!r}")
    return mode


def tile_mode() -> str:
    """The process's tile mode: :func:`set_tile_mode`'s, else ``$QPASS_TRITON_TILES``, else ``autotune``.

    Raises:
        ValueError: ``$QPASS_TRITON_TILES`` holds another value.
    """
    m = _MODE[0]
    if m is not None:
        return m
    return _check(os.environ.get(ENV, "autotune") or "autotune", f"${ENV}")


def set_tile_mode(mode: str | None) -> None:
    """Set the process's tile mode (None: back to the environment / default).

    Raises:
        ValueError: unknown mode.
    """
    _MODE[0] = None if mode is None else _check(mode, "tile mode")


@contextlib.contextmanager
def tile_mode_scope(mode: str) -> Iterator[None]:
    """``with tile_mode_scope("pinned"):`` (restores the previous setting)."""
    prev = _MODE[0]
    set_tile_mode(mode)
    try:
        yield
    finally:
        _MODE[0] = prev


def _key(shape: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={shape[k]}" for k in sorted(shape))


def pinned_tile(kernel: str, **shape: Any) -> Tile | None:
    """The tile a launcher must use for ``kernel`` at ``shape``, or None to let the autotuner pick.

    Under ``pinned`` the choice is :data:`RULES` ``[kernel](shape)`` and is recorded under
    ``(kernel, shape)`` for :func:`report`. Keep ``shape`` to what the autotuner's key holds.

    Raises:
        KeyError: no rule for ``kernel``.
    """
    if tile_mode() != "pinned":
        return None
    tile = RULES[kernel](shape)
    with _LOCK:
        _RECORD.setdefault(kernel, {})[_key(shape)] = tile.describe()
    return tile


def reset_record() -> None:
    """Forget the recorded choices (tests)."""
    with _LOCK:
        _RECORD.clear()


def report(*, autotuned: bool = True) -> dict[str, Any]:
    """What the run's launches used: ``{"mode", "pinned": {kernel: {shape key: tile}}, "autotuned": {...}}``.

    ``autotuned``: also read the picks of the GPU kernel modules' autotuners (their caches; only
    when the GPU copy of the kernels was loaded), as ``qpass bench`` records them.
    """
    with _LOCK:
        out: dict[str, Any] = {"mode": tile_mode(), "pinned": {k: dict(v) for k, v in _RECORD.items()}}
    if autotuned:
        out["autotuned"] = _autotuned()
    return out


def _autotuned() -> dict[str, dict[str, str]]:
    import sys

    lib = sys.modules.get("qpass.backends.triton._kernels_gpu")
    if lib is None:
        return {}
    found: dict[str, dict[str, str]] = {}
    for mod, names in (("nvfp4_gemm", ("_gemm_small", "_gemm_large")), ("nvfp4_gemv", ("_gemv_auto", "_gemv_split")),
                       ("nvfp4_quant", ("_quant_tuned",)), ("rac", ("_masked_tuned",)), ("fp8", ("_fp8_gemm_tuned",))):
        m = getattr(lib, mod, None)
        for nm in names:
            tuner = getattr(m, nm, None)
            for sub, t in (tuner.items() if isinstance(tuner, dict) else [(None, tuner)]):
                cache = getattr(t, "cache", None)
                if cache:
                    found[nm if sub is None else f"{nm}[{sub}]"] = {str(k): str(v) for k, v in cache.items()}
    return found
