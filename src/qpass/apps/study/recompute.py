"""Recompute a ``qpass study``'s gaps and paired-bootstrap CIs from its ``gaps.safetensors``.

``qpass study`` stores every learner's ``log p`` and every rollout's ``log q`` on the fixed token set
(plus the valid mask) beside ``study.json``. :func:`recompute` verifies the file against the sha256
recorded in ``study.json``, rebuilds ``d = log p - log q`` for every pair ``study.json`` lists, and
recomputes each pair's summary (:func:`qpass.apps.study.replay.gap_summary`) and every paired
comparison (:func:`qpass.apps.study.replay.paired_bootstrap`, same seed and resample count), so any
CI of a study can be re-derived, or computed at another level or with another resampling, without
the model. ``recompute(dir)["matches"]`` says whether the recomputed numbers equal the stored ones.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from qpass.errors import QpassError

__all__ = ["load_gaps", "recompute"]


def load_gaps(study_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(study.json, tensors)`` of a study directory, the tensors checked against the recorded sha256.

    Raises:
        QpassError: no study.json / gaps file, or the file's sha256 differs from the one recorded.
    """
    from safetensors.torch import load_file

    d = Path(study_dir)
    try:
        res = json.loads((d / "study.json").read_text())
    except (OSError, ValueError) as exc:
        raise QpassError(f"{d}: cannot read study.json: {exc}") from None
    info = res.get("gaps_file")
    if not info:
        raise QpassError(f"{d}/study.json records no gaps file (a study written before per-response gaps were stored)")
    path = d / info["path"]
    if not path.is_file():
        raise QpassError(f"{path}: missing (study.json records it)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != info["sha256"]:
        raise QpassError(f"{path}: sha256 {digest} differs from the {info['sha256']} study.json records")
    return res, load_file(str(path))


def recompute(study_dir: str | Path) -> dict[str, Any]:
    """Pair summaries and paired comparisons recomputed from the stored log-probs.

    Returns:
        ``{"pairs": {name: summary}, "comparisons": {name: {"diff", "lo", "hi", "n_responses"}},
        "matches": bool, "mismatches": [names]}`` (``matches``: every recomputed number equals the
        stored one exactly).
    """
    from qpass.apps.study.replay import gap_summary, paired_bootstrap, pair_metrics
    from qpass.apps.study.run import MODES, SELECTIONS, _comparison_list

    res, t = load_gaps(study_dir)
    valid = t["valid"].bool()
    pairs = {k: (p["learner"], p["rollout"]) for k, p in res["pairs"].items() if not p.get("skipped") and "replay" in p}
    d = {k: t[f"logp.{lname}"] - t[f"logq.{rname}"] for k, (lname, rname) in pairs.items()}
    out_pairs = {k: gap_summary(pair_metrics(t[f"logp.{lname}"], t[f"logq.{rname}"], valid)) for k, (lname, rname) in pairs.items()}
    cfg = res["config"]
    ratios = tuple(cfg["ratios"])
    combos = [(m, s) for m in MODES for s in SELECTIONS]
    comps = {f"{a}_vs_{b}": paired_bootstrap(d[a], d[b], valid, n_boot=cfg["bootstrap"], seed=cfg["seed"])
             for a, b in _comparison_list(ratios, combos) if a in d and b in d}
    from qpass.apps.study.run import _clean

    mism = [k for k, v in out_pairs.items() if _clean(v) != {kk: res["pairs"][k]["replay"].get(kk) for kk in v}]
    mism += [k for k, v in comps.items() if _clean(v) != res["comparisons"].get(k)]
    return {"pairs": out_pairs, "comparisons": comps, "matches": not mism, "mismatches": mism}
