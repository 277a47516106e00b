"""Sums, means and norms that stay finite for huge but finite inputs (rescale before summing).

A float64 sum of finite terms overflows to ``inf`` once it passes ``DBL_MAX`` (1.8e308) even when the
mean is representable, and ``inf - inf`` then gives NaN (a sum of ``[1e308, 1e308, -1e308, -1e308]``
in pairwise order); a sum of squares overflows from ``1.3e154``. The functions here scale the terms by
a power of two ``2^-e`` first, when (and only when) the largest magnitude is large enough to overflow
the reduction, and undo it on the result: power-of-two scaling is exact for normal numbers, and
ordinary inputs take the unscaled path, so their results are bit-identical to a plain sum.

Used by the SPEC §4 diagnostics (:mod:`qpass.diagnostics.metrics`, :mod:`qpass.diagnostics.layerwise`),
the apply's per-site activation mismatch and the RL loss statistics (:mod:`qpass.rl.loss`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["norm_ratio", "pow2_exponent", "scaled", "stable_mean", "stable_norm", "stable_row_mean", "unscale"]

_LOG2_MAX = 1020.0  # log2 of what a reduction may reach (DBL_MAX = 2^1024), with headroom


def pow2_exponent(amax: float, n: int, power: int = 1) -> int:
    """``e >= 0`` such that a sum of ``n`` terms of magnitude ``<= (amax · 2^-e)^power`` stays below 2^1020;
    0 when no scaling is needed (or ``amax`` is 0, inf or NaN: nothing to gain). The scaled largest
    magnitude is in ``[2, 4)``, so the scale factor ``2^-e`` is a normal float64."""
    if not (math.isfinite(amax) and amax > 0):
        return 0
    if power * math.log2(amax) + math.log2(max(n, 1)) < _LOG2_MAX:
        return 0
    return max(math.frexp(amax)[1] - 2, 0)


def scaled(x: torch.Tensor, e: int) -> torch.Tensor:
    """``x · 2^-e`` (exact for normal results)."""
    return x if e == 0 else x * (2.0 ** -e)


def unscale(v: float, e: int) -> float:
    """``v · 2^e`` (``math.ldexp``), ``+-inf`` where that exceeds ``DBL_MAX`` (ldexp raises there)."""
    try:
        return math.ldexp(v, e)
    except OverflowError:
        return math.copysign(math.inf, v)


def _amax(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def stable_mean(x: torch.Tensor, count: float) -> float:
    """``sum(x) / count`` (float64 ``x``, zeros where not counted; ``count`` the denominator, usually
    the number of counted terms), finite whenever the mean is.

    Returns NaN for ``count == 0`` (no data). A NaN or inf term gives the plain sum's result.
    """
    if not count:
        return math.nan
    e = pow2_exponent(_amax(x), x.numel())
    if e == 0:
        return float(x.sum()) / count
    return unscale(float(scaled(x, e).sum()) / count, e)


def stable_row_mean(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per row of ``x [R, T]`` (float64): ``sum(x[r]) / counts[r]`` (``counts`` float64, > 0), with one
    power-of-two scale for all rows (so rows of ordinary size are not touched when none is huge)."""
    e = pow2_exponent(_amax(x), x.shape[-1] if x.dim() else 1)
    if e == 0:
        return x.sum(-1) / counts
    return (scaled(x, e).sum(-1) / counts) * 2.0 ** e  # e <= 1022: 2^e is a normal float64


def stable_norm(x: torch.Tensor, e: int | None = None) -> float:
    """``||x||_2`` (float64), computed on ``x · 2^-e`` when the squares would overflow; ``inf`` only when
    the norm itself exceeds ``DBL_MAX``."""
    if e is None:
        e = pow2_exponent(_amax(x), x.numel(), power=2)
    v = float(torch.linalg.vector_norm(scaled(x.double(), e)))
    return unscale(v, e) if e else v


def norm_ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    """``||num|| / ||den||`` with one common scale (finite even when both norms overflow float64).

    Returns 0 when both are 0, ``inf`` when only ``den`` is.
    """
    e = pow2_exponent(max(_amax(num), _amax(den)), max(num.numel(), den.numel()), power=2)
    a = float(torch.linalg.vector_norm(scaled(num.double(), e)))
    b = float(torch.linalg.vector_norm(scaled(den.double(), e)))
    if b == 0:
        return 0.0 if a == 0 else math.inf
    return a / b
