"""``weight_qdq`` (learner): NVFP4 weight fake-quant with a straight-through estimator (SPEC §3.1).

Before::

    w = get_attr[model.layers.0.self_attn.q_proj.weight]
    y = aten.linear(x, w)

After (one ``group_amax`` per fused group, recomputed on every forward from the current weights,
SPEC §3 rule 2)::

    amax = qpass.group_amax([w_q, w_k, w_v])
    y = qpass.nvfp4_qdq_linear(x, w_q, amax, None, "model.layers.0.self_attn.q_proj")

``nvfp4_qdq_linear`` multiplies the exact operand ``B_W = e2m1 * s_b`` of the weight's NVFP4
quantization and applies ``S_dec_W`` once to the output, ``y = fl(acc(X B_W^T) * S_dec_W)``: the
factored decode the rollout's GEMMs compute. Its backward is the STE with ``W_hat = B_W * S_dec_W``
(``dL/dW = dL/dW_hat``, ``dL/dX = S_dec_W * (dL/dY B_W)``), so the optimizer updates the BF16
master weights. The rollout's ``w4a4_lower`` quantizes with the same function, the same groups and
the same amax rule: learner and rollout multiply bit-identical operands and scale by the same
``S_dec_W`` bits, which is what makes ``Delta W_q`` identical on both sides (QUADS learner side).

The op comes from the ``learner_qdq`` table of the weight spec (``format``: ``nvfp4`` with its
``arithmetic``, ``fp8`` with a ``granularity``, ``mxfp4``), like the rollout lowerings come from
``rollout_lower``: FP8 and MXFP4 (no global scale, no fused group amax) get
``qpass.qdq_linear(x, w, bias, spec_key, site)``, which multiplies the float32 decode the rollout's
reference op multiplies.
"""

from __future__ import annotations

from typing import Literal

import torch

from qpass.formats.spec import FP8Spec, Granularity, MXFP4_WEIGHT, QuantSpec, nvfp4_weight_spec
from qpass.graph.qgraph import QGraph
from qpass.graph.records import SiteQuant
from qpass.compiler.manager import PassContext, Rewrites, register_pass
from qpass.quant import qdq  # noqa: F401 - registers the ops

from qpass.compiler.passes._common import (FormatOptions, QDQPass, bias_arg, copy_meta, graph_order, grouped, k_aligned,
                                           selected, with_linear_nodes)


class WeightQDQOptions(FormatOptions):
    FOREIGN = {"arithmetic": ("nvfp4", "has none"), "granularity": ("fp8", "has none")}

    format: Literal["nvfp4", "fp8", "mxfp4"] = "nvfp4"
    arithmetic: Literal["te_reference", "modelopt"] = "te_reference"  # nvfp4: NVFP4Spec.arithmetic; the rollout lowering must match
    granularity: Literal["block_128x128", "per_tensor"] = "block_128x128"  # fp8: the weight scales (fp8_lower's weight_granularity)

    def spec(self) -> QuantSpec:
        """The weight spec these options name."""
        if self.format == "fp8":
            return FP8Spec(role="weight", granularity=Granularity(self.granularity))
        if self.format == "mxfp4":
            return MXFP4_WEIGHT
        return nvfp4_weight_spec(self.arithmetic)


@register_pass
class WeightQDQ(QDQPass):
    """Insert the weight spec's STE weight-QDQ linear on every targeted linear (learner)."""

    name = "weight_qdq"
    Options = WeightQDQOptions
    sides = ("learner",)
    ensures = ("weight_qdq",)

    def run(self, qg: QGraph, ctx: PassContext) -> Rewrites:
        spec, lq, k_multiple = self.entries()
        sites, skipped = selected(qg, self.options)
        out = Rewrites(skipped=skipped)
        ok = k_aligned(sites, k_multiple, out)
        g = qg.gm.graph
        order = graph_order(qg)
        op = lq.overload("linear")
        groups = grouped(ok) if spec.has_global_scale else {s.id: [s] for s in ok}
        for gid, members in groups.items():
            members, nodes = with_linear_nodes(qg, members, out, "quantized")
            if not members:
                continue
            amax = None
            if spec.has_global_scale:  # one fresh amax per fused group (SPEC §3 rules 1, 2)
                first = min((n for s in members for n in nodes[s.id]), key=order.__getitem__)
                w_nodes = [nodes[s.id][0].args[1] for s in members]
                with g.inserting_before(first):
                    amax = g.call_function(torch.ops.qpass.group_amax.default, (w_nodes,))
                amax.meta.update(qpass_site=gid, qpass_group=gid)
            for s in members:
                for lin in nodes[s.id]:
                    with g.inserting_before(lin):
                        new = g.call_function(op, lq.linear_args(spec, lin.args[0], lin.args[1], amax, bias_arg(lin), s.id))
                    copy_meta(lin, new, qpass_qdq_site=s.id)
                    lin.replace_all_uses_with(new)
                    g.erase_node(lin)
                prev = qg.quant.get(s.id)
                qg.quant[s.id] = SiteQuant(
                    site=s.id, weight=s.weight, group=gid, members=tuple(m.id for m in members), spec=spec,
                    act_spec=prev.act_spec if prev else None, op=lq.ops["linear"],
                )
                out.rewrote(s.id)
        out.details["groups"] = len({qg.quant[s].group for s in out.rewritten})
        return out
