"""Weight sync learner -> rollout: re-quantize from the current master weights (fresh amax).

SPEC rules 2-3: the rollout receives codes, scale bytes and global scales produced by the one
reference quantizer from the learner's current weights; it never re-quantizes BF16 weights itself
and never reuses a stale amax. Unquantized parameters (norms, embeddings, lm_head) are copied.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import torch

from qpass.errors import QpassError
from qpass.formats.spec import FP8Spec, Granularity
from qpass.graph.qgraph import QGraph
from qpass.passes.nvfp4_lower import quantize_site_weights
from qpass.quant.fp8 import fp8_quantize
from qpass.quant.mxfp4 import mxfp4_quantize


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

    ``learner`` is the learner graph or its master weights by graph attribute path.

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
    groups: dict[str, list[str]] = {}
    for sid, rec in rollout.quant.items():
        if rec.get("kind") == "nvfp4_linear":
            groups.setdefault(rec["group"], []).append(sid)
    for gid, sids in groups.items():
        weights, names = {}, {}
        for sid in sids:
            src = rollout.quant[sid]["weight"]
            if src not in lparams:
                raise QpassError(f"weight sync: rollout site {sid} has no source weight {src} in the learner graph")
            weights[sid], names[sid] = lparams[src].detach(), src
        quantized = quantize_site_weights(weights, names)
        parts = []
        for sid in sids:
            consts = rollout.quant[sid]["constants"]
            q = quantized[sid]
            for key, val in (("codes", q.codes), ("scales", q.scales), ("s_dec", q.s_dec), ("s_enc", q.s_enc)):
                rollout.gm.get_buffer(consts[key]).copy_(val)
            parts += [q.codes, q.scales, q.s_dec]
            requantized += 1
        fingerprints[gid] = fingerprint(*parts)
    for sid, rec in rollout.quant.items():
        if rec.get("kind") == "mxfp4_linear":
            q = mxfp4_quantize(lparams[rec["weight"]].detach(), site=sid)
            rollout.gm.get_buffer(rec["constants"]["codes"]).copy_(q.codes)
            rollout.gm.get_buffer(rec["constants"]["scales"]).copy_(q.scales)
            fingerprints[sid] = fingerprint(q.codes, q.scales)
            requantized += 1
        if rec.get("kind") == "fp8_linear":
            wspec = FP8Spec(role="weight", granularity=Granularity(rec["spec"].rsplit(".", 1)[-1]))
            q = fp8_quantize(lparams[rec["weight"]].detach(), spec=wspec, site=sid)
            rollout.gm.get_buffer(rec["constants"]["data"]).copy_(q.data)
            rollout.gm.get_buffer(rec["constants"]["scale"]).copy_(q.scale)
            fingerprints[sid] = fingerprint(q.data, q.scale)
            requantized += 1
    return SyncReport(copied, requantized, fingerprints)
