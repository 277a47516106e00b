"""``act_qdq``: dynamic NVFP4 activation fake-quant on the input of targeted linears.

On the learner it builds the *symmetric* W4A4-QAT ablation (QUADS: activation QDQ on the learner
does not close the gap and can widen it); on the rollout, without weight lowering, it builds the
W16A4 operand ablation. Backward is the STE.

Before: ``y = aten.linear(x, w)``. After: ``y = aten.linear(qpass.nvfp4_act_qdq(x, site, per_token), w)``.
"""

from __future__ import annotations

import dataclasses

import torch

from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_PER_TOKEN
from qpass.graph.qgraph import QGraph
from qpass.graph.records import SiteQuant
from qpass.graph.sites import LINEAR_TARGETS
from qpass.pm import Pass, PassContext, PassOptions, PassResult, register_pass
from qpass.quant import qdq  # noqa: F401

from qpass.passes.common import copy_meta, finish, selected


class ActQDQOptions(PassOptions):
    per_token: bool = False


@register_pass
class ActQDQ(Pass):
    """Insert dynamic NVFP4 activation QDQ before targeted linears (learner or rollout)."""

    name = "act_qdq"
    Options = ActQDQOptions
    sides = ("learner", "rollout")
    requires = ("sites_stamped",)
    ensures = ("act_qdq",)

    def run(self, qg: QGraph, ctx: PassContext) -> PassResult:
        res = PassResult(self.name, qg.side)
        sites, res.skipped = selected(qg, self.options, need_nvfp4=True)
        g = qg.gm.graph
        spec = NVFP4_ACT_PER_TOKEN if self.options.per_token else NVFP4_ACT
        for s in sites:
            linears = (*LINEAR_TARGETS, torch.ops.qpass.nvfp4_qdq_linear.default)  # aten, or weight_qdq's op: x is arg 0
            nodes = [n for n in qg.nodes_of_site(s.id) if n.target in linears]
            if not nodes:
                res.skipped.append((s.id, "no aten.linear node (lowered to a quantized op already)"))
                continue
            for lin in nodes:
                x = lin.args[0]
                if isinstance(x, torch.fx.Node) and x.target == torch.ops.qpass.nvfp4_act_qdq.default:
                    res.skipped.append((s.id, "input already quantized"))
                    continue
                with g.inserting_before(lin):
                    xq = g.call_function(torch.ops.qpass.nvfp4_act_qdq.default, (x, s.id, self.options.per_token))
                copy_meta(x if isinstance(x, torch.fx.Node) else lin, xq, qpass_site=s.id, qpass_act_site=s.id)
                lin.update_arg(0, xq)
            prev = qg.quant.get(s.id)
            qg.quant[s.id] = (dataclasses.replace(prev, act_spec=spec) if prev else SiteQuant(
                site=s.id, weight=s.weight, group=s.group, members=(s.id,), act_spec=spec, op="qpass::nvfp4_act_qdq"))
            res.sites.append(s.id)
        res.matches = len(res.sites)
        res.changed = res.matches > 0
        finish(qg)
        return res
