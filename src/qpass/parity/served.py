"""Bit-level parity read from the engine: the bytes a rollout engine serves versus qpass's quantizer
of the learner's master weights (SPEC §3 rules 1-3), through the engine protocols only.

Works for any :class:`qpass.runtime.engine.RolloutEngine` (its ``served_weights()`` read back from
the engine's own storage) and any weights in Hugging Face names (``LearnerEngine.export_weights()``).
NVFP4 sites are checked (one shared amax per fused group, fresh from the weights); ``unquantized``
sites (activation-only, e.g. W16A4: the engine serves the weight itself) are compared bit for bit with
the master weight cast to the served dtype (round to nearest even, as the export writes it); other
formats are counted as not checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from qpass.formats.spec import NVFP4_WEIGHT
from qpass.quant.nvfp4 import NVFP4Tensor
from qpass.quant.weights import quantize_site_weights
from qpass.runtime.served import ServedSite


@dataclasses.dataclass(frozen=True)
class ServedCheck:
    """Outcome of :func:`check_served_weights`.

    Attributes:
        ok: every checked site equals the quantizer's bytes.
        checked: sites compared (NVFP4 and unquantized).
        skipped: sites of other formats (not compared).
        mismatches: ``"site: what differs"`` in site order; the first names the first differing site.
        unquantized: of ``checked``, the activation-only sites, compared as unquantized weights in the
            served dtype (no NVFP4 bytes exist for them).
    """

    ok: bool
    checked: int
    skipped: int
    mismatches: tuple[str, ...]
    unquantized: int = 0


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    ne = (a != b).nonzero()
    return f"{len(ne)}/{a.numel()} differ (first at {tuple(ne[0].tolist())})"


def _compare(sid: str, q: NVFP4Tensor, s: ServedSite) -> list[str]:
    """``"site: what differs"`` for the codes, scale bytes and global-scale bits of ``q`` vs ``s``."""
    bad = []
    dev = s.codes.device
    for what, mine, theirs in (
        ("codes", q.codes.to(dev), s.codes),
        ("scale bytes", q.scales.to(dev).view(torch.uint8), s.scales.view(torch.uint8)),
        ("global scale bits", q.s_dec.to(dev).float().reshape(-1).view(torch.int32),
         s.global_scale.float().reshape(-1).view(torch.int32) if s.global_scale is not None else torch.empty(0, dtype=torch.int32)),
    ):
        if mine.shape != theirs.shape or not torch.equal(mine, theirs):
            bad.append(f"{sid}: {what} {_first_diff(mine, theirs)}")
    return bad


@torch.no_grad()
def check_learner_bytes(learner_sites: Mapping[str, NVFP4Tensor], served: Mapping[str, ServedSite]) -> ServedCheck:
    """Compare the NVFP4 weights a learner's fake-quantized forward uses (per site, e.g.
    ``MegatronLearner.fake_quant_sites()``) with the bytes the rollout engine serves.

    Every served NVFP4 site must have a learner entry (a missing one is a mismatch naming it);
    learner sites the engine does not serve as NVFP4 are ignored.

    Returns:
        :class:`ServedCheck` (``skipped``: served sites of other formats).
    """
    bad: list[str] = []
    checked = skipped = 0
    for sid in sorted(served):
        s = served[sid]
        if s.format != "nvfp4":
            skipped += 1
            continue
        if sid not in learner_sites:
            bad.append(f"{sid}: the learner does not fake-quantize this served NVFP4 site")
            continue
        checked += 1
        bad += _compare(sid, learner_sites[sid], s)
    return ServedCheck(not bad, checked, skipped, tuple(bad))


@torch.no_grad()
def check_served_weights(weights: Mapping[str, torch.Tensor], served: Mapping[str, ServedSite]) -> ServedCheck:
    """Compare each served NVFP4 site with ``nvfp4_quantize`` of ``weights[site + ".weight"]``, and
    each served ``unquantized`` (activation-only) site with ``weights[site + ".weight"]`` cast to the
    served dtype, bit for bit.

    Args:
        weights: master weights by HF name (``model.layers.0.mlp.up_proj.weight``).
        served: ``RolloutEngine.served_weights()``.
    Returns:
        :class:`ServedCheck` (codes, scale bytes and global-scale bits compared; unquantized weights'
        bits compared; a missing weight is a mismatch naming it).
    """
    groups: dict[str, list[str]] = {}
    skipped = unquantized = 0
    bad: list[str] = []
    checked = 0
    for sid in sorted(served):
        s = served[sid]
        if s.format == "nvfp4":
            groups.setdefault(s.group or sid, []).append(sid)
        elif s.format == "unquantized":
            checked += 1
            unquantized += 1
            w = weights.get(f"{sid}.weight")
            if w is None:
                bad.append(f"{sid}: no master weight {sid}.weight")
                continue
            mine = w.detach().to(device=s.codes.device, dtype=s.codes.dtype).contiguous()
            if mine.shape != s.codes.shape:
                bad.append(f"{sid}: unquantized weight ({s.codes.dtype}) shape {tuple(mine.shape)} != {tuple(s.codes.shape)}")
            elif not torch.equal(mine.view(torch.uint8), s.codes.contiguous().view(torch.uint8)):
                bad.append(f"{sid}: unquantized weight ({s.codes.dtype}) bits {_first_diff(mine.view(torch.uint8), s.codes.contiguous().view(torch.uint8))}")
        else:
            skipped += 1
    for gid in sorted(groups):
        sids = groups[gid]
        missing = [f"{s}.weight" for s in sids if f"{s}.weight" not in weights]
        if missing:
            bad += [f"{m[: -len('.weight')]}: no master weight {m}" for m in missing]
            continue
        quantized = quantize_site_weights(NVFP4_WEIGHT, {s: weights[f"{s}.weight"] for s in sids},
                                          names={s: f"{s}.weight" for s in sids})
        for sid in sids:
            checked += 1
            bad += _compare(sid, quantized[sid].tensor, served[sid])
    bad.sort(key=lambda m: m.split(":")[0])
    return ServedCheck(not bad, checked, skipped, tuple(bad), unquantized)
