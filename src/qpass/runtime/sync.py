"""Weight sync learner -> rollout: re-quantize from the current master weights (fresh amax).

SPEC §3 rules 2-3: the rollout receives codes, scale bytes and global scales produced by the one
reference quantizer from the learner's current weights; it never re-quantizes BF16 weights itself
and never reuses a stale amax. Unquantized parameters (norms, embeddings, lm_head) are copied.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import torch

from qpass.errors import QpassError
from qpass.graph.qgraph import QGraph
from qpass.graph.records import SiteQuant
from qpass.progress import track
from qpass.quant.weights import quantize_site_weights
from qpass.tables import entry


@dataclasses.dataclass
class SyncReport:
    """What a sync did: parameters copied, sites re-quantized, and a fingerprint per group."""

    copied: int
    requantized: int
    fingerprints: dict[str, str]


def fingerprint(*tensors: torch.Tensor) -> str:
    """sha256 (16 hex digits) over the raw bytes of ``tensors``: a cheap per-group parity fingerprint."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def sync_weights(learner: QGraph | Mapping[str, torch.Tensor], rollout: QGraph) -> SyncReport:
    """Refresh every rollout weight from the learner's current master weights, in place.

    ``learner`` is the learner graph or its master weights by graph attribute path. Each
    quantization group (a fused group for specs with a global scale, else one site) is
    re-quantized with :func:`qpass.quant.weights.quantize_site_weights` (fresh group amax) and its
    constants overwrite the rollout buffers named in the site records.

    Raises:
        QpassError: a rollout constant has no source weight in the learner graph.
    """
    lparams = dict(learner) if isinstance(learner, Mapping) else dict(learner.gm.named_parameters(remove_duplicate=False))
    copied = 0
    for path, p in rollout.gm.named_parameters(remove_duplicate=False):
        if path in lparams:
            p.copy_(lparams[path].detach())
            copied += 1
    requantized = 0
    fingerprints: dict[str, str] = {}
    groups: dict[str, list[SiteQuant]] = {}
    for rec in rollout.quant.values():
        if rec.lowered:
            groups.setdefault(rec.group, []).append(rec)
    for gid, recs in track(groups.items(), "weight sync: re-quantize the rollout weights", unit="group"):
        weights = {}
        for rec in recs:
            if rec.weight not in lparams:
                raise QpassError(f"weight sync: rollout site {rec.site} has no source weight {rec.weight} in the learner graph")
            weights[rec.site] = lparams[rec.weight].detach()
        quantized = quantize_site_weights(recs[0].spec, weights, names={r.site: r.weight for r in recs})
        parts = []
        for rec in recs:
            consts = quantized[rec.site].constants
            for key, attr in rec.constants.items():
                rollout.gm.get_buffer(attr).copy_(consts[key])
            lowering = entry("rollout_lower", rec.spec)
            parts += [consts[k] for k in lowering.constant_args]
            rollout.quant[rec.site] = dataclasses.replace(rec, flushed_blocks=quantized[rec.site].flushed_blocks)
            requantized += 1
        fingerprints[gid] = fingerprint(*parts)
    return SyncReport(copied, requantized, fingerprints)
