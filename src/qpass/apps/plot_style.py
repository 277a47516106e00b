"""Shared matplotlib conventions of qpass's plots (apply's report plots, GRPO curves)."""

from __future__ import annotations

from typing import Any

__all__ = ["readable_log_ticks"]


def readable_log_ticks(ax: Any, axis: str = "y") -> None:
    """Plain tick labels on a log axis (``0.3``, ``2``, ``50``); when the axis spans less than about a decade
    and a half, a few labelled minor ticks (2 and 5 x 10^k, plus 3 under one decade) — instead of a lone
    ``10^0`` or matplotlib's crowd of ``1.9x10^0`` labels. Call after the limits are final."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    plain = FuncFormatter(lambda v, _pos: f"{v:.3g}")
    target.set_major_formatter(plain)
    if lo > 0 and hi / lo < 30:
        target.set_minor_locator(LogLocator(base=10, subs=(2.0, 3.0, 5.0) if hi / lo < 10 else (2.0, 5.0)))
        target.set_minor_formatter(plain)
    else:
        target.set_minor_formatter(NullFormatter())
