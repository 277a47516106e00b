"""Layer-wise input mismatch for the QUADS study: asymmetric W4A16 QAT vs symmetric W4A4 QAT.

At every linear site the study compares the ``pre`` input (the activation before any activation
quantization: ``X_roll - X_learn`` is the drift accumulated upstream, ``eta`` in SPEC §2) and the
``eff`` operand the GEMM multiplies (``X_eff,roll - X_eff,learn = eta + Delta X_q`` asymmetric, or
``Q(X_roll) - Q(X_learn)`` symmetric) of the learner's scoring graph and the rollout's step graph,
on the same token sequences. Capture and comparison are the shared ones of
:mod:`qpass.diagnostics.capture` (with ``effective=True``); this module adds the study's views.

The rollout runs in two modes: **prefill** (the whole prompt + response in one step-graph call,
the brief's definition) and **decode** (the rows recorded while replaying the tokens one decode step
at a time with :class:`qpass.diagnostics.capture.DecodeRecorder`: what the rollout computes when it samples).
"""

from __future__ import annotations

import torch

from qpass.diagnostics.capture import (  # noqa: F401 - re-exported: the study's capture is the shared one
    Acts,
    DecodeRecorder,
    compare_captures,
    effective_nvfp4_input,
)
from qpass.diagnostics.capture import capture_learner as _capture_learner
from qpass.diagnostics.capture import capture_prefill as _capture_prefill
from qpass.diagnostics.layerwise import SiteMismatch
from qpass.graph.qgraph import QGraph


def capture_scoring(learner: QGraph, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Acts:
    """``(pre, eff)`` per site of the learner's full-sequence forward, each ``[B, T, K]``
    (:func:`qpass.diagnostics.capture.capture_learner` with ``effective=True``)."""
    return _capture_learner(learner, input_ids, attention_mask, effective=True)


def capture_prefill(rollout: QGraph, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Acts:
    """``(pre, eff)`` per site of one step-graph call over the whole sequence
    (:func:`qpass.diagnostics.capture.capture_prefill` with ``effective=True``; ValueError as there)."""
    return _capture_prefill(rollout, input_ids, attention_mask, effective=True)


def scored_positions_mask(attention_mask: torch.Tensor, response_mask: torch.Tensor, prompt_len: int,
                          n_real: int) -> torch.Tensor:
    """bool ``[B, P + R - 1]``: positions whose logits score a valid response token of a real row.

    Position ``t`` (``P - 1 <= t < P + R - 1``) produces the distribution of response token
    ``t - P + 1``; it counts iff that token is valid. ``attention_mask`` is only used for its shape.
    """
    b, total = attention_mask.shape
    r = total - prompt_len
    m = torch.zeros(b, total - 1, dtype=torch.bool)
    m[:, prompt_len - 1:] = response_mask.cpu()[:, :r].bool()
    m[n_real:] = False
    return m


def compare(learner: Acts, rollout: Acts, mask: torch.Tensor) -> dict[str, dict[str, SiteMismatch]]:
    """Per site, ``{"pre": SiteMismatch, "eff": SiteMismatch}`` on the rows of ``mask`` [B, T']
    (:func:`qpass.diagnostics.capture.compare_captures`: both captures cut to ``T'`` positions first;
    the site sets must be equal)."""
    return compare_captures(learner, rollout, mask, which=("pre", "eff"), strict=True).per_site


def summarize(per_site: dict[str, dict[str, SiteMismatch]]) -> dict[str, dict[str, float]]:
    """Mean / median / max over sites of the relative mismatch, for ``pre`` and ``eff``."""
    out = {}
    for key in ("pre", "eff"):
        rel = torch.tensor([v[key].rel for v in per_site.values()], dtype=torch.float64)
        out[key] = {"mean_rel": float(rel.mean()), "median_rel": float(rel.median()), "max_rel": float(rel.max()),
                    "sites": int(rel.numel())}
    return out


def per_site_table(per_site: dict[str, dict[str, SiteMismatch]]) -> dict[str, dict[str, float]]:
    """JSON form: ``{site: {"pre_rel", "pre_fro", "eff_rel", "eff_fro", "tokens"}}``."""
    return {s: {"pre_rel": v["pre"].rel, "pre_fro": v["pre"].fro, "eff_rel": v["eff"].rel, "eff_fro": v["eff"].fro,
                "tokens": v["pre"].n_tokens} for s, v in per_site.items()}

