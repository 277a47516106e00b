"""``fp8_lower`` (rollout): W8A8 FP8 E4M3 linear with block scales (the baseline users pick on Hopper).

Before: ``y = aten.linear(x, w)``. After::

    y = qpass.fp8_linear(x, w_fp8, w_scale, bias, site, act_granularity="block_1x128",
                         w_granularity="block_128x128")

Weights are quantized once (128x128 blocks, decode scales ``amax/448``); activations dynamically
per 1x128 block (DeepSeek style) at every call.
"""

from __future__ import annotations

from typing import Literal

import torch

from qpass import ops  # noqa: F401 - registers qpass::fp8_linear
from qpass.formats.spec import FP8Spec, Granularity
from qpass.graph.qgraph import QGraph
from qpass.pm import Pass, PassContext, PassOptions, PassResult, register_pass
from qpass.quant.fp8 import fp8_quantize

from qpass.passes.common import aten_linear_nodes, bias_arg, replace_linear, selected


class FP8LowerOptions(PassOptions):
    act_granularity: Literal["block_1x128", "per_token", "per_tensor"] = "block_1x128"
    weight_granularity: Literal["block_128x128", "per_tensor"] = "block_128x128"


@register_pass
class FP8Lower(Pass):
    """Replace targeted linears by ``qpass.fp8_linear`` (rollout)."""

    name = "fp8_lower"
    Options = FP8LowerOptions
    sides = ("rollout",)
    requires = ("sites_stamped",)
    ensures = ("fp8_lowered",)

    def run(self, qg: QGraph, ctx: PassContext) -> PassResult:
        o = self.options
        res = PassResult(self.name, qg.side)
        sites, res.skipped = selected(qg, o)
        wspec = FP8Spec(role="weight", granularity=Granularity(o.weight_granularity))
        for s in sites:
            nodes = aten_linear_nodes(qg, s.id)
            if not nodes:
                res.skipped.append((s.id, "no unrewritten aten.linear node"))
                continue
            q = fp8_quantize(qg.attr(str(nodes[0].args[1].target)).detach(), spec=wspec, name=s.weight, site=s.id)
            names = replace_linear(
                qg, s, nodes, torch.ops.qpass.fp8_linear.default, {"data": q.data, "scale": q.scale},
                lambda lin, c, s=s: (lin.args[0], c[0], c[1], bias_arg(lin), s.id, o.act_granularity, o.weight_granularity),
            )
            qg.quant[s.id] = {"kind": "fp8_linear", "spec": wspec.key, "act_spec": f"fp8_e4m3.activation.{o.act_granularity}",
                              "group": s.id, "members": [s.id], "weight": s.weight, "constants": names}
            res.sites.append(s.id)
        res.matches = len(res.sites)
        res.changed = res.matches > 0
        res.details["removed_params"] = len(qg.prune())
        return res
