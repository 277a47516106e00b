"""Overlay plots of GRPO runs (matplotlib, Agg backend): one panel per metric, one line per run.

A run directory (written by ``qpass grpo``) holds ``metrics.jsonl`` (one row per step),
``eval.jsonl`` (held-out accuracy, including step 0) and ``config.json`` (its ``recipe`` names the
line). Panel presets (:data:`PRESETS`, ``qpass grpo-plot --preset``):

* ``default``: the SPEC §4 gap ``G_abs`` of ``(p_prox, q)`` (token mean), ``max|d|``, the mean
  training reward and the held-out accuracy;
* ``quads``: the curves of QUADS Fig. 1 / Fig. 6 (reward, held-out accuracy, ``G_abs``, ``max|d|``
  vs step) plus the clip fraction per advantage sign of the loss's ratio and of the coupled ratio
  ``p_theta / q`` over every update forward, and the clip-branch disagreement against the BF16
  shadow engine per sign;
* ``cost``: held-out accuracy and ``G_abs`` against the cumulative rollout seconds of the run
  (``time/rollout_s_cum``: accuracy at matched rollout cost; any metrics key can be the x axis,
  ``qpass grpo-plot --x KEY``). An eval at step ``s`` is placed at the x value of step ``s``'s row
  (step 0 at 0).

Runs with the same recipe (seeds of one arm) are labelled by their directory name.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qpass.apps.plot_style import readable_log_ticks
from qpass.atomic import write_atomic
from qpass.apps.grpo.jsonl import read_jsonl

__all__ = ["COST_PANELS", "DEFAULT_PANELS", "PRESETS", "PRESET_X", "QUADS_PANELS", "Panel", "RunData", "load_run", "plot_runs",
           "runs_figure"]


@dataclasses.dataclass(frozen=True)
class Panel:
    """One subplot: ``key`` of a metrics row (or ``eval/...`` from eval.jsonl), title, log y-axis."""

    key: str
    title: str
    log_y: bool = False


DEFAULT_PANELS: tuple[Panel, ...] = (
    Panel("gap/token/g_abs", "G_abs = mean |log p_prox - log q| (token mean)", log_y=True),
    Panel("gap/max_abs", "max |log p_prox - log q|", log_y=True),
    Panel("reward/mean", "training reward (mean)"),
    Panel("eval/accuracy", "held-out accuracy"),
)

QUADS_PANELS: tuple[Panel, ...] = (
    Panel("reward/mean", "training reward (mean)"),
    Panel("eval/accuracy", "held-out accuracy (greedy, rollout engine)"),
    Panel("gap/token/g_abs", "G_abs = mean |log p_prox - log q| (token mean)", log_y=True),
    Panel("gap/max_abs", "max |log p_prox - log q|", log_y=True),
    Panel("loss/clip_pos_frac", "clip fraction, A > 0 (loss ratio, all update forwards)"),
    Panel("loss/clip_neg_frac", "clip fraction, A < 0 (loss ratio, all update forwards)"),
    Panel("loss/coupled_clip_pos_frac", "clip fraction of p_theta / q, A > 0"),
    Panel("loss/coupled_clip_neg_frac", "clip fraction of p_theta / q, A < 0"),
    Panel("clip/frac_pos", "clip-branch disagreement vs BF16 shadow, A > 0"),
    Panel("clip/frac_neg", "clip-branch disagreement vs BF16 shadow, A < 0"),
)

COST_PANELS: tuple[Panel, ...] = (
    Panel("eval/accuracy", "held-out accuracy vs cumulative rollout seconds"),
    Panel("gap/token/g_abs", "G_abs vs cumulative rollout seconds", log_y=True),
)

#: Named panel sets of :func:`plot_runs` (``qpass grpo-plot --preset``).
PRESETS: dict[str, tuple[Panel, ...]] = {"default": DEFAULT_PANELS, "quads": QUADS_PANELS, "cost": COST_PANELS}
#: The x axis each preset uses unless ``x`` is given (``"step"`` or a metrics key).
PRESET_X: dict[str, str] = {"default": "step", "quads": "step", "cost": "time/rollout_s_cum"}


@dataclasses.dataclass
class RunData:
    """A run's label and rows."""

    label: str
    rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """``(xs, values)`` of ``key`` (eval keys from eval.jsonl); missing / null values skipped.

        ``x``: ``"step"`` or a metrics key; a row's x is the value of that key in the metrics row of
        its step (0 at step 0; rows whose step has no finite x are skipped).
        """
        src = self.eval_rows if key.startswith("eval/") and self.eval_rows else self.rows
        xmap = None if x == "step" else {int(r["step"]): r.get(x) for r in self.rows}
        xs, ys = [], []
        for r in src:
            v = r.get(key)
            s = int(r["step"])
            xv: Any = s if xmap is None else (0.0 if s == 0 else xmap.get(s))
            if not (isinstance(xv, (int, float)) and not isinstance(xv, bool) and math.isfinite(xv)):
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(xv)
                ys.append(float(v))
        return xs, ys


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir`` (the message names the directory).
    """
    d = Path(run_dir)
    m = d / "metrics.jsonl"
    if not m.is_file():
        raise FileNotFoundError(f"{d} is not a GRPO run directory (no metrics.jsonl)")
    label = d.name
    cfg = d / "config.json"
    if cfg.is_file():
        try:
            label = str(json.loads(cfg.read_bytes()).get("recipe", label) or label)
        except (ValueError, AttributeError):  # an unreadable config only loses the label
            pass
    ev = d / "eval.jsonl"
    return RunData(label, read_jsonl(m), read_jsonl(ev) if ev.is_file() else [])


def _smooth(ys: list[float], k: int) -> list[float]:
    if k <= 1:
        return ys
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _frame_sparse(ax: Any, series: list[tuple[list[int], list[float]]], log_y: bool) -> None:
    """Axis limits for a panel whose data is one step or one value (matplotlib's automatic limits then
    collapse to a point or pick a range of +-1e-x around it): one step either side, and a y range of a
    factor 2 (log) or +-10 % (at least 0.05) around a constant value."""
    xs = {x for sx, _ in series for x in sx}
    ys = [y for _, sy in series for y in sy]
    if len(xs) == 1:
        x = next(iter(xs))
        ax.set_xlim(x - 1, x + 1)
    if ys and max(ys) == min(ys):
        y = ys[0]
        if log_y:
            ax.set_ylim(y / 2, y * 2)
        else:
            pad = max(abs(y) * 0.1, 0.05)
            ax.set_ylim(y - pad, y + pad)


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    *,
    panels: Sequence[Panel] | Sequence[str] | None = None,
    smooth: int = 1,
    title: str | None = None,
    preset: str = "default",
    x: str | None = None,
) -> Path:
    """Overlay the runs in ``run_dirs`` on one figure and save it atomically to ``out`` (PNG).

    Args:
        run_dirs: run directories (each with metrics.jsonl).
        out: output image path (extension picks the format).
        panels: :class:`Panel` s or metric keys (default: the ``preset``'s).
        preset: a key of :data:`PRESETS` (used when ``panels`` is None).
        smooth: trailing moving-average window over steps (1 = raw).
        title: figure title.
        x: the x axis: ``"step"`` or a metrics key such as ``time/rollout_s_cum`` (default: the
            preset's, :data:`PRESET_X`).
    Returns:
        ``out`` as a Path.
    Raises:
        ValueError: no run directories, ``smooth < 1`` or an unknown preset.
        FileNotFoundError: see :func:`load_run`.
    """
    fig = runs_figure(run_dirs, panels=panels, smooth=smooth, title=title, preset=preset, x=x)  # selects the Agg backend
    import matplotlib.pyplot as plt

    out = Path(out)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=110, format=out.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    write_atomic(out, buf.getvalue())
    return out


def runs_figure(
    run_dirs: Sequence[str | Path],
    *,
    panels: Sequence[Panel] | Sequence[str] | None = None,
    smooth: int = 1,
    title: str | None = None,
    preset: str = "default",
    x: str | None = None,
) -> Any:
    """The matplotlib figure :func:`plot_runs` saves (same arguments, same errors)."""
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    if preset not in PRESETS:
        raise ValueError(f"unknown plot preset {preset!r}; presets: {sorted(PRESETS)}")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ps = [p if isinstance(p, Panel) else Panel(p, p) for p in (panels or PRESETS[preset])]
    x = x or PRESET_X[preset]
    runs = [load_run(d) for d in run_dirs]
    labels = [r.label for r in runs]
    for r, d in zip(runs, run_dirs):  # seeds of one recipe: name them by directory
        if labels.count(r.label) > 1:
            r.label = Path(d).name
    ncol = 2 if len(ps) > 1 else 1
    nrow = math.ceil(len(ps) / ncol)
    # constrained layout keeps the suptitle above the first row's panel titles
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.0 * ncol, 3.6 * nrow), squeeze=False, layout="constrained")
    from matplotlib.ticker import MaxNLocator

    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    for ax, panel in zip(axes.flat, ps):
        drawn: list[tuple[list[int], list[float]]] = []
        for k, run in enumerate(runs):
            xs, ys = run.series(panel.key, x)
            if not xs:
                continue
            if panel.log_y and any(y <= 0 for y in ys):
                xs, ys = zip(*[(xv, y) for xv, y in zip(xs, ys) if y > 0]) if any(y > 0 for y in ys) else ([], [])
                xs, ys = list(xs), list(ys)
                if not xs:
                    continue
            ys = _smooth(ys, smooth)
            few = len(xs) <= 2
            ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=6 if few else 3, label=run.label,
                    color=colors[k % len(colors)])  # one color per run in every panel
            if few:  # one or two points: print the values, a lone marker says little on its own
                for xv, y in zip(xs, ys):
                    ax.annotate(f"{y:.4g}", (xv, y), textcoords="offset points", xytext=(6, 6), fontsize=7,
                                color=colors[k % len(colors)])
            drawn.append((xs, ys))
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(x if x != "step" else "step")
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.log_y and drawn:
            ax.set_yscale("log")
        if drawn:
            if max(len(sx) for sx, _ in drawn) <= 2:
                ax.margins(x=0.15, y=0.25)  # room for the value labels
            _frame_sparse(ax, drawn, panel.log_y)
            if panel.log_y:
                readable_log_ticks(ax)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no data for {panel.key}", ha="center", va="center", transform=ax.transAxes, fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(ps):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return fig
