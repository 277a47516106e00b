"""A written definition of training collapse, as a function over a run's eval and gap series.

**Definition** (issue 13; defaults ``drop = 0.10``, ``patience = 3``). Let ``acc_0, acc_1, ...``
be the held-out accuracies of a run at its eval steps ``s_0 < s_1 < ...`` and ``g(s)`` the
rollout-learner gap (``G_abs`` of ``p`` vs ``q``) of the policy evaluated at step ``s``. The run
**collapses at eval k** when, for the window ``W = {k - patience + 1, ..., k}`` of ``patience``
consecutive evals,

1. every eval in ``W`` is at least ``drop`` below the run's best so far:
   ``max(acc_0, ..., acc_j) - acc_j >= drop`` for all ``j`` in ``W`` (up to 1e-9 of float
   rounding); and
2. the gap has risen: ``g(s_j) > g(s_b)`` for all ``j`` in ``W``, where ``b`` is the (first) eval
   index of the running best at the window's first eval.

The first such ``k`` is reported (``step = s_k``, onset ``s_{k - patience + 1}``). A run without
such a window has **not collapsed within its observation limit**: its last eval step, and the
number of evals (fewer than ``patience + 1`` evals cannot show a collapse at all).

Units: accuracies are fractions (``drop = 0.10`` is 10 percentage points); gaps in nats.

**Accuracy collapse** (reported beside the written definition, never in place of it): condition 1
alone (``require_gap_rise=False``; :func:`accuracy_collapse_summary`). The H100 naive_nvfp4 run of
2026-12-05 fell from 0.765 to 0.025 while its gap fell, so it collapses by accuracy only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CollapseResult", "accuracy_collapse_summary", "collapse_summary", "detect_collapse"]

_TOL = 1e-9  # float rounding of accuracy differences (0.42 - 0.32 = 0.09999999999999998)


@dataclasses.dataclass(frozen=True)
class CollapseResult:
    """Result of :func:`detect_collapse`.

    Attributes:
        collapsed: a window satisfying the definition exists.
        step: eval step ``s_k`` at which the collapse is declared (None if not collapsed).
        onset_step: first step of that window.
        best_step, best_accuracy: the running best the window fell from (None if not collapsed).
        n_evals: evals considered (those with both an accuracy and a gap).
        observed_until: last eval step considered (the observation limit; None without evals).
        drop, patience: the definition's parameters.
    """

    collapsed: bool
    step: int | None
    onset_step: int | None
    best_step: int | None
    best_accuracy: float | None
    n_evals: int
    observed_until: int | None
    drop: float
    patience: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def detect_collapse(steps: Sequence[int], accuracy: Sequence[float], gap: Sequence[float], *,
                    drop: float = 0.10, patience: int = 3, require_gap_rise: bool = True) -> CollapseResult:
    """Apply the module's collapse definition to aligned series.

    Args:
        steps: eval steps, strictly increasing.
        accuracy: held-out accuracy (fraction in [0, 1]) per eval step.
        gap: the gap of the evaluated policy per eval step (finite; nats).
        drop: accuracy drop below the running best (> 0, fraction).
        patience: consecutive evals (>= 1).
        require_gap_rise: condition 2 (the written definition); False: accuracy collapse (condition 1 only).
    Raises:
        ValueError: lengths differ, steps not increasing, non-finite values, bad ``drop``/``patience``.
    """
    if not (len(steps) == len(accuracy) == len(gap)):
        raise ValueError(f"steps, accuracy and gap must have one length, got {len(steps)}, {len(accuracy)}, {len(gap)}")
    if not drop > 0 or patience < 1:
        raise ValueError(f"need drop > 0 and patience >= 1, got drop={drop}, patience={patience}")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"steps must be strictly increasing, got {list(steps)}")
    if not all(math.isfinite(x) for x in [*accuracy, *gap]):
        raise ValueError("accuracy and gap must be finite")
    n = len(steps)
    best_idx = []  # index of the running best at each eval (first occurrence)
    for j in range(n):
        best_idx.append(j if j == 0 or accuracy[j] > accuracy[best_idx[-1]] else best_idx[-1])
    below = [accuracy[best_idx[j]] - accuracy[j] >= drop - _TOL for j in range(n)]
    for k in range(patience - 1, n):
        window = range(k - patience + 1, k + 1)
        b = best_idx[window[0]]
        if all(below[j] for j in window) and (not require_gap_rise or all(gap[j] > gap[b] for j in window)):
            return CollapseResult(True, int(steps[k]), int(steps[window[0]]), int(steps[b]), float(accuracy[b]), n,
                                  int(steps[-1]), drop, patience)
    return CollapseResult(False, None, None, None, None, n, int(steps[-1]) if n else None, drop, patience)


def collapse_summary(eval_rows: Sequence[Mapping[str, Any]], metric_rows: Sequence[Mapping[str, Any]], *,
                     drop: float = 0.10, patience: int = 3, gap_key: str = "gap/token/g_abs") -> dict[str, Any]:
    """:func:`detect_collapse` over a GRPO run's ``eval.jsonl`` and ``metrics.jsonl`` rows.

    The gap of the policy evaluated at step ``s`` (weights after step ``s``) is the one step
    ``s + 1`` measured on its rollout (``metrics`` row ``s + 1``: ``p_prox`` is that policy); for the
    last eval, which has no next row, the row of step ``s`` itself. Evals without an accuracy or a
    finite gap are skipped.

    Returns:
        :meth:`CollapseResult.to_dict` plus ``"definition"`` (one line) and ``"gap_key"``.
    """
    gaps = {int(r["step"]): r.get(gap_key) for r in metric_rows}
    steps, acc, gap = [], [], []
    seen: set[int] = set()
    for r in eval_rows:
        s, a = int(r["step"]), r.get("eval/accuracy")
        g = gaps.get(s + 1, gaps.get(s))
        if s in seen or not isinstance(a, (int, float)) or not isinstance(g, (int, float)) or not math.isfinite(g):
            continue
        seen.add(s)
        steps.append(s)
        acc.append(float(a))
        gap.append(float(g))
    order = sorted(range(len(steps)), key=steps.__getitem__)
    res = detect_collapse([steps[i] for i in order], [acc[i] for i in order], [gap[i] for i in order], drop=drop, patience=patience)
    return {**res.to_dict(), "gap_key": gap_key,
            "definition": f"eval >= {drop * 100:g} pp below the run's best for {patience} consecutive evals while the gap "
                          f"({gap_key}) is above its value at the best eval (qpass.diagnostics.collapse)"}


def accuracy_collapse_summary(eval_rows: Sequence[Mapping[str, Any]], *, drop: float = 0.10,
                              patience: int = 3) -> dict[str, Any]:
    """Accuracy collapse (condition 1 of the definition only) over a run's ``eval.jsonl`` rows.

    Returns:
        :meth:`CollapseResult.to_dict` plus ``"definition"``.
    """
    steps, acc, seen = [], [], set()
    for r in sorted(eval_rows, key=lambda r: int(r["step"])):
        s, a = int(r["step"]), r.get("eval/accuracy")
        if s in seen or not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a):
            continue
        seen.add(s)
        steps.append(s)
        acc.append(float(a))
    res = detect_collapse(steps, acc, [0.0] * len(acc), drop=drop, patience=patience, require_gap_rise=False)
    return {**res.to_dict(), "definition": f"eval >= {drop * 100:g} pp below the run's best for {patience} consecutive "
                                           "evals (accuracy alone; qpass.diagnostics.collapse)"}
