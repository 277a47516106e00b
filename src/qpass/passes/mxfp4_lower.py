"""``mxfp4_lower`` (rollout): MXFP4 weight-only linear (E2M1 codes, E8M0 power-of-two scale per 32).

Before: ``y = aten.linear(x, w)``. After: ``y = qpass.mxfp4_linear(x, codes, e8m0_scales, bias, site)``.
The OCP MX format has no global scale; it is here as the comparison point for NVFP4's finer
(1x16, E4M3) scaling. K must be a multiple of 32.
"""

from __future__ import annotations

import torch

from qpass import ops  # noqa: F401 - registers qpass::mxfp4_linear
from qpass.formats.spec import MXFP4_WEIGHT
from qpass.graph.qgraph import QGraph
from qpass.pm import Pass, PassContext, PassOptions, PassResult, register_pass
from qpass.quant.mxfp4 import mxfp4_quantize

from qpass.passes.common import aten_linear_nodes, bias_arg, replace_linear, selected


@register_pass
class MXFP4Lower(Pass):
    """Replace targeted linears by ``qpass.mxfp4_linear`` (rollout, W4A16 MXFP4)."""

    name = "mxfp4_lower"
    Options = PassOptions
    sides = ("rollout",)
    requires = ("sites_stamped",)
    ensures = ("mxfp4_lowered",)

    def run(self, qg: QGraph, ctx: PassContext) -> PassResult:
        res = PassResult(self.name, qg.side)
        sites, res.skipped = selected(qg, self.options)
        for s in sites:
            if s.in_features % 32:
                res.skipped.append((s.id, f"in_features={s.in_features} is not a multiple of 32"))
                continue
            nodes = aten_linear_nodes(qg, s.id)
            if not nodes:
                res.skipped.append((s.id, "no unrewritten aten.linear node"))
                continue
            q = mxfp4_quantize(qg.attr(str(nodes[0].args[1].target)).detach(), name=s.weight, site=s.id)
            names = replace_linear(
                qg, s, nodes, torch.ops.qpass.mxfp4_linear.default, {"codes": q.codes, "scales": q.scales},
                lambda lin, c, s=s: (lin.args[0], c[0], c[1], bias_arg(lin), s.id),
            )
            qg.quant[s.id] = {"kind": "mxfp4_linear", "spec": MXFP4_WEIGHT.key, "group": s.id, "members": [s.id],
                              "weight": s.weight, "constants": names}
            res.sites.append(s.id)
        res.matches = len(res.sites)
        res.changed = res.matches > 0
        res.details["removed_params"] = len(qg.prune())
        return res
