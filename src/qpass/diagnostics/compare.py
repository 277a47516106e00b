"""Between-arm comparisons of GRPO runs: block-bootstrap CIs over seeds and steps (``qpass grpo-compare``).

An **arm** is a set of runs that differ only in their seed (``qpass grpo-sweep`` names them
``<arm>_s<seed>``). For a metric and a window of each run's series (:class:`Window`):

* a run's value is the mean of its series over the window;
* an arm's value is the mean of its runs' values (every seed weighs the same);
* the difference of two arms is ``value(A) - value(B)``.

Its confidence interval is a two-level percentile bootstrap (:func:`bootstrap_diff`): each replicate
resamples an arm's runs with replacement (when it has more than one), then each drawn run's series
with **circular moving blocks** of ``block`` consecutive points (Künsch 1989), so the serial
correlation of a training curve within the block length is kept. With one seed per arm only the
within-run (step) variation enters, which is the CI a single-seed comparison can give and no more;
the result says how many runs each arm had.

Collapse is reported per run twice, separately: by the written definition (accuracy drop *and* a
risen gap, :func:`qpass.diagnostics.collapse.collapse_summary`) and by accuracy alone
(:func:`qpass.diagnostics.collapse.accuracy_collapse_summary`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Window", "arm_of", "bootstrap_diff", "compare_runs", "parse_metric"]

_SEED_SUFFIX = re.compile(r"_s(\d+)$")


def arm_of(run_name: str) -> tuple[str, int | None]:
    """``("naive_nvfp4", 2)`` for ``naive_nvfp4_s2``; ``(name, None)`` without a ``_s<seed>`` suffix."""
    m = _SEED_SUFFIX.search(run_name)
    return (run_name[: m.start()], int(m.group(1))) if m else (run_name, None)


@dataclasses.dataclass(frozen=True)
class Window:
    """Which points of a series count: ``all``, the ``last`` N points, or steps ``lo``..``hi`` inclusive."""

    kind: str = "all"
    n: int = 0
    lo: int = 0
    hi: int = 0

    @classmethod
    def parse(cls, text: str) -> "Window":
        """``all`` | ``last:N`` | ``steps:LO-HI``.

        Raises:
            ValueError: anything else (the message shows the accepted forms).
        """
        t = text.strip()
        if t == "all":
            return cls()
        m = re.fullmatch(r"last:(\d+)", t)
        if m and int(m.group(1)) >= 1:
            return cls("last", n=int(m.group(1)))
        m = re.fullmatch(r"steps:(\d+)-(\d+)", t)
        if m and int(m.group(1)) <= int(m.group(2)):
            return cls("steps", lo=int(m.group(1)), hi=int(m.group(2)))
        raise ValueError(f"window must be 'all', 'last:N' (N >= 1) or 'steps:LO-HI' (LO <= HI), got {text!r}")

    def select(self, steps: Sequence[int], values: Sequence[float]) -> list[float]:
        pts = list(zip(steps, values))
        if self.kind == "last":
            pts = pts[-self.n:]
        elif self.kind == "steps":
            pts = [(s, v) for s, v in pts if self.lo <= s <= self.hi]
        return [v for _, v in pts]

    def describe(self) -> str:
        return {"all": "all", "last": f"last:{self.n}", "steps": f"steps:{self.lo}-{self.hi}"}[self.kind]


def parse_metric(spec: str) -> tuple[str, Window]:
    """``KEY`` or ``KEY@WINDOW`` (e.g. ``eval/accuracy@last:3``) -> ``(key, Window)``.

    Raises:
        ValueError: empty key or a bad window.
    """
    key, _, win = spec.partition("@")
    if not key.strip():
        raise ValueError(f"metric must be KEY or KEY@WINDOW, got {spec!r}")
    return key.strip(), Window.parse(win) if win else Window()


def _block_resample(x: np.ndarray, block: int, rng: np.random.Generator) -> np.ndarray:
    n = x.size
    b = max(1, min(block, n))
    starts = rng.integers(0, n, size=math.ceil(n / b))
    idx = (starts[:, None] + np.arange(b)[None, :]).reshape(-1)[:n] % n
    return x[idx]


def bootstrap_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], *, block: int = 5, n_boot: int = 2000,
                   seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """``mean_runs(mean(a_i)) - mean_runs(mean(b_j))`` and its two-level block-bootstrap interval.

    Args:
        a, b: per run of each arm, the windowed series (each non-empty).
        block: moving-block length in points (1: i.i.d. points).
        n_boot: replicates. level: two-sided percentile level.
    Returns:
        ``{"diff", "lo", "hi", "a", "b", "runs_a", "runs_b", "points_a", "points_b", "block", "level"}``.
    Raises:
        ValueError: an arm without runs, or a run without points.
    """
    if not a or not b:
        raise ValueError("bootstrap_diff needs at least one run per arm")
    ra = [np.asarray(x, dtype=np.float64) for x in a]
    rb = [np.asarray(x, dtype=np.float64) for x in b]
    if any(x.size == 0 for x in ra + rb):
        raise ValueError("bootstrap_diff: a run has no points in the window")
    va, vb = float(np.mean([x.mean() for x in ra])), float(np.mean([x.mean() for x in rb]))
    rng = np.random.default_rng(seed)

    def draw(runs: list[np.ndarray]) -> float:
        pick = [runs[i] for i in rng.integers(0, len(runs), size=len(runs))] if len(runs) > 1 else runs
        return float(np.mean([_block_resample(x, block, rng).mean() for x in pick]))

    boots = np.array([draw(ra) - draw(rb) for _ in range(n_boot)])
    lo, hi = np.quantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"diff": va - vb, "lo": float(lo), "hi": float(hi), "a": va, "b": vb, "runs_a": len(ra), "runs_b": len(rb),
            "points_a": [int(x.size) for x in ra], "points_b": [int(x.size) for x in rb], "block": block, "level": level}


def _series(run: Any, key: str) -> tuple[list[int], list[float]]:
    xs, ys = run.series(key)
    return [int(x) for x in xs], ys


def compare_runs(arms: Mapping[str, Sequence[str | Path]], metrics: Sequence[tuple[str, Window]], *,
                 load: Callable[[str | Path], Any], block: int = 5, n_boot: int = 2000, seed: int = 0,
                 baseline: str | None = None) -> dict[str, Any]:
    """Every metric's per-arm value and the between-arm differences with CIs, plus both collapse verdicts per run.

    Args:
        arms: arm name -> run directories (its seeds).
        load: reads one run directory into an object with ``rows`` and ``eval_rows`` (lists of dicts) and
            ``series(key) -> (xs, ys)``: :func:`qpass.apps.grpo.plots.load_run`, passed in by the app so
            this core module does not import the app layer.
        metrics: ``(key, window)``; ``eval/...`` keys read ``eval.jsonl``, others ``metrics.jsonl``.
        block: moving-block length for step series (eval series use 1: evals are sparse).
        baseline: compare every arm against this one only (default: every pair).
    Raises:
        ValueError: an unknown baseline, an arm without runs, a run without a complete metric row.
            FileNotFoundError: not a run dir.
    """
    from qpass.diagnostics.collapse import accuracy_collapse_summary, collapse_summary

    if baseline is not None and baseline not in arms:
        raise ValueError(f"--baseline {baseline!r} is not an arm; arms: {sorted(arms)}")
    loaded = {name: [(Path(d).name, load(d)) for d in dirs] for name, dirs in arms.items()}
    for name, runs in loaded.items():
        if not runs:
            raise ValueError(f"arm {name!r} has no runs")
        for (_, run), d in zip(runs, arms[name]):
            if not run.rows:
                raise ValueError(f"{Path(d) / 'metrics.jsonl'} holds no complete metric row (nothing to compare)")
    out: dict[str, Any] = {"schema": "qpass.grpo_compare/1", "block": block, "n_boot": n_boot, "seed": seed,
                           "arms": {n: [r for r, _ in runs] for n, runs in loaded.items()}, "metrics": {}, "collapse": {}}
    if baseline is None:
        pairs = list(itertools.combinations(loaded, 2))
    else:
        pairs = [(n, baseline) for n in loaded if n != baseline]
    for key, win in metrics:
        per_arm: dict[str, Any] = {}
        series: dict[str, list[list[float]]] = {}
        for name, runs in loaded.items():
            vals = []
            for rname, run in runs:
                v = win.select(*_series(run, key))
                if v:
                    vals.append(v)
            series[name] = vals
            per_arm[name] = {"runs": len(vals), "per_run": [float(np.mean(v)) for v in vals],
                             "mean": float(np.mean([np.mean(v) for v in vals])) if vals else None}
        blk = 1 if key.startswith("eval/") else block
        diffs = {}
        for x, y in pairs:
            if series[x] and series[y]:
                diffs[f"{x}_vs_{y}"] = bootstrap_diff(series[x], series[y], block=blk, n_boot=n_boot, seed=seed)
            else:
                diffs[f"{x}_vs_{y}"] = {"skipped": "no data in the window"}
        out["metrics"][f"{key}@{win.describe()}"] = {"key": key, "window": win.describe(), "per_arm": per_arm, "pairs": diffs}
    for name, runs in loaded.items():
        for rname, run in runs:
            out["collapse"][rname] = {"arm": name, "written_definition": collapse_summary(run.eval_rows, run.rows),
                                      "accuracy_only": accuracy_collapse_summary(run.eval_rows)}
    return out


def to_markdown(res: Mapping[str, Any]) -> str:
    """Tables of :func:`compare_runs`'s result (per-arm values, differences with CIs, collapse verdicts)."""
    lines = ["# GRPO arm comparison", "",
             f"Two-level block bootstrap ({res['n_boot']} replicates, block {res['block']} steps; evals: block 1): "
             "runs resampled within an arm, then points in circular moving blocks within a run.", ""]
    for name, m in res["metrics"].items():
        lines += [f"## {name}", "", "| arm | runs | mean | per run |", "| --- | ---: | ---: | --- |"]
        for arm, v in m["per_arm"].items():
            mean = "-" if v["mean"] is None else f"{v['mean']:.4f}"
            lines.append(f"| {arm} | {v['runs']} | {mean} | {', '.join(f'{x:.4f}' for x in v['per_run'])} |")
        lines += ["", "| A vs B | A - B | 95% CI |", "| --- | ---: | --- |"]
        for pair, d in m["pairs"].items():
            if "skipped" in d:
                lines.append(f"| {pair} | - | {d['skipped']} |")
            else:
                lines.append(f"| {pair} | {d['diff']:+.4f} | [{d['lo']:+.4f}, {d['hi']:+.4f}] (runs {d['runs_a']} / {d['runs_b']}) |")
        lines.append("")
    lines += ["## Collapse", "", "| run | arm | written definition | accuracy alone |", "| --- | --- | --- | --- |"]

    def verdict(c: Mapping[str, Any]) -> str:
        if c.get("collapsed"):
            return f"collapsed at step {c['step']} (from {c['best_accuracy']:.3f} at step {c['best_step']})"
        return f"none within {c.get('observed_until')} steps ({c.get('n_evals')} evals)"

    for run, c in res["collapse"].items():
        lines.append(f"| {run} | {c['arm']} | {verdict(c['written_definition'])} | {verdict(c['accuracy_only'])} |")
    return "\n".join(lines) + "\n"
