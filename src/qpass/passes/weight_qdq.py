"""``weight_qdq`` (learner): NVFP4 weight fake-quant with a straight-through estimator (SPEC §3.1).

Before::

    w = get_attr[model.layers.0.self_attn.q_proj.weight]
    y = aten.linear(x, w)

After (one ``group_amax`` per fused group, recomputed on every forward from the current weights,
SPEC rule 2)::

    amax = qpass.group_amax([w_q, w_k, w_v])
    y = qpass.nvfp4_qdq_linear(x, w_q, amax, None, "model.layers.0.self_attn.q_proj")

``nvfp4_qdq_linear`` multiplies the exact operand ``B_W = e2m1 * s_b`` of the weight's NVFP4
quantization and applies ``S_dec_W`` once to the output, ``y = fl(acc(X B_W^T) * S_dec_W)``: the
factored decode the rollout's GEMMs compute. Its backward is the STE with ``W_hat = B_W * S_dec_W``
(``dL/dW = dL/dW_hat``, ``dL/dX = S_dec_W * (dL/dY B_W)``), so the optimizer updates the BF16
master weights. The rollout's ``w4a4_lower`` quantizes with the same function, the same groups and
the same amax rule: learner and rollout multiply bit-identical operands and scale by the same
``S_dec_W`` bits, which is what makes ``Delta W_q`` identical on both sides (QUADS learner side).
"""

from __future__ import annotations

from typing import Literal

import torch

from qpass.formats.spec import nvfp4_weight_spec
from qpass.graph.qgraph import QGraph
from qpass.graph.records import SiteQuant
from qpass.pm import Pass, PassContext, PassOptions, PassResult, register_pass
from qpass.quant import qdq  # noqa: F401 - registers the ops

from qpass.passes.common import aten_linear_nodes, bias_arg, copy_meta, finish, graph_order, grouped, selected


class WeightQDQOptions(PassOptions):
    format: Literal["nvfp4"] = "nvfp4"
    arithmetic: Literal["te_reference", "modelopt"] = "te_reference"  # NVFP4Spec.arithmetic; the rollout lowering must match


@register_pass
class WeightQDQ(Pass):
    """Insert STE NVFP4 QDQ on every targeted linear weight (learner)."""

    name = "weight_qdq"
    Options = WeightQDQOptions
    sides = ("learner",)
    requires = ("sites_stamped",)
    ensures = ("weight_qdq",)

    def run(self, qg: QGraph, ctx: PassContext) -> PassResult:
        res = PassResult(self.name, qg.side)
        sites, res.skipped = selected(qg, self.options, need_nvfp4=True)
        g = qg.gm.graph
        order = graph_order(qg)
        spec = nvfp4_weight_spec(self.options.arithmetic)
        extra = () if spec.arithmetic == "te_reference" else (spec.arithmetic,)  # the default is not spelled out
        for gid, members in grouped(sites).items():
            nodes = {s.id: aten_linear_nodes(qg, s.id) for s in members}
            for s in members:
                if not nodes[s.id]:
                    res.skipped.append((s.id, "no unrewritten aten.linear node (already quantized?)"))
            members = [s for s in members if nodes[s.id]]
            if not members:
                continue
            first = min((n for s in members for n in nodes[s.id]), key=order.__getitem__)
            w_nodes = [nodes[s.id][0].args[1] for s in members]
            with g.inserting_before(first):
                amax = g.call_function(torch.ops.qpass.group_amax.default, (w_nodes,))
            amax.meta.update(qpass_site=gid, qpass_group=gid)
            op = torch.ops.qpass.nvfp4_qdq_linear.default
            for s in members:
                for lin in nodes[s.id]:
                    with g.inserting_before(lin):
                        new = g.call_function(op, (lin.args[0], lin.args[1], amax, bias_arg(lin), s.id, *extra))
                    copy_meta(lin, new, qpass_qdq_site=s.id)
                    lin.replace_all_uses_with(new)
                    g.erase_node(lin)
                prev = qg.quant.get(s.id)
                qg.quant[s.id] = SiteQuant(
                    site=s.id, weight=s.weight, group=gid, members=tuple(m.id for m in members), spec=spec,
                    act_spec=prev.act_spec if prev else None, op="qpass::nvfp4_qdq_linear",
                )
                res.sites.append(s.id)
        res.matches = len(res.sites)
        res.changed = res.matches > 0
        res.details["groups"] = len({qg.quant[s].group for s in res.sites})
        finish(qg)
        return res
