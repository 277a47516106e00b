"""``act_qdq``: dynamic NVFP4 activation fake-quant on the input of targeted linears.

On the learner it builds the *symmetric* W4A4-QAT ablation (QUADS: activation QDQ on the learner
does not close the gap and can widen it); on the rollout, without weight lowering, it builds the
W16A4 operand ablation. Backward is the STE.

Before: ``y = aten.linear(x, w)``. After: ``y = aten.linear(qpass.nvfp4_act_qdq(x, site, per_token), w)``.

The op comes from the ``learner_qdq`` table of the activation spec (``format``: ``nvfp4`` with
``per_token``, or ``fp8`` with a ``granularity``: ``qpass.qdq(x, None, spec_key, site)``). After
``weight_qdq`` the linear is its weight-QDQ op, whose input is argument 0 as well.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from qpass.formats.spec import FP8Spec, Granularity, QuantSpec, nvfp4_act_spec_of
from qpass.graph.qgraph import QGraph, learner_linear_targets
from qpass.graph.records import SiteQuant
from qpass.graph.sites import LINEAR_TARGETS
from qpass.compiler.manager import PassContext, Rewrites, register_pass
from qpass.quant import qdq  # noqa: F401

from qpass.compiler.passes._common import FormatOptions, QDQPass, copy_meta, selected


class ActQDQOptions(FormatOptions):
    FOREIGN = {"per_token": ("nvfp4", "uses granularity"), "granularity": ("fp8", "has none")}

    format: Literal["nvfp4", "fp8"] = "nvfp4"
    per_token: bool = False  # nvfp4: one dynamic global scale per row
    granularity: Literal["block_1x128", "per_token", "per_tensor"] = "block_1x128"  # fp8: the activation scales

    def spec(self) -> QuantSpec:
        """The activation spec these options name."""
        if self.format == "fp8":
            return FP8Spec(role="activation", granularity=Granularity(self.granularity))
        return nvfp4_act_spec_of("nvfp4_per_token" if self.per_token else "nvfp4")


@register_pass
class ActQDQ(QDQPass):
    """Insert dynamic activation QDQ (the spec's ``learner_qdq`` op) before targeted linears (learner or rollout)."""

    name = "act_qdq"
    Options = ActQDQOptions
    sides = ("learner", "rollout")
    ensures = ("act_qdq",)

    def run(self, qg: QGraph, ctx: PassContext) -> Rewrites:
        spec, lq, k_multiple = self.entries()
        op = lq.overload("activation")
        sites, skipped = selected(qg, self.options)
        out = Rewrites(skipped=skipped)
        g = qg.gm.graph
        linears = (*LINEAR_TARGETS, *learner_linear_targets())
        for s in sites:
            if s.in_features % k_multiple:
                out.skip(s.id, f"in_features={s.in_features} is not a multiple of {k_multiple}")
                continue
            nodes = [n for n in qg.nodes_of_site(s.id) if n.target in linears]  # aten, or weight_qdq's op: x is arg 0
            if not nodes:
                out.skip(s.id, "no aten.linear node (lowered to a quantized op already)")
                continue
            for lin in nodes:
                x = lin.args[0]
                if isinstance(x, torch.fx.Node) and x.target == op:
                    out.skip(s.id, "input already quantized")
                    continue
                with g.inserting_before(lin):
                    xq = g.call_function(op, lq.act_args(spec, x, s.id))
                copy_meta(x if isinstance(x, torch.fx.Node) else lin, xq, qpass_site=s.id, qpass_act_site=s.id)
                lin.update_arg(0, xq)
            prev = qg.quant.get(s.id)
            qg.quant[s.id] = (dataclasses.replace(prev, act_spec=spec) if prev else SiteQuant(
                site=s.id, weight=s.weight, group=s.group, members=(s.id,), act_spec=spec, op=lq.ops["activation"]))
            out.rewrote(s.id)
        return out

