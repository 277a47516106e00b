"""``w4a4_lower`` / ``w4a16_lower`` (rollout): replace a linear by the NVFP4 rollout op.

Before::

    y = aten.linear(x, get_attr[model.layers.0.mlp.down_proj.weight])

After (the weight's packed codes, E4M3 scale bytes and decode global scale become constants of the
graph; the BF16 weight is dropped from the rollout graph)::

    y = qpass.nvfp4_linear(x, codes, scales, s_dec, None, "model.layers.0.mlp.down_proj",
                           act="nvfp4", rac_ratio=0.0, rac_mode="masked", rac_selection="batch", None)

Weights are quantized with :func:`qpass.nvfp4_quantize`, the very quantizer behind the learner's
``nvfp4_qdq``, with one shared amax per fused group (q/k/v, gate/up). ``act`` picks W4A4 (dynamic
per-tensor activation global scale), W4A4 with per-token global scales, or W4A16 (``none``).
"""

from __future__ import annotations

import re
from typing import Literal

import torch

from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_PER_TOKEN, NVFP4_WEIGHT
from qpass import ops  # noqa: F401 - registers qpass::nvfp4_linear / qpass::fp8_linear
from qpass.graph.qgraph import QGraph
from qpass.pm import Pass, PassContext, PassOptions, PassResult, register_pass
from qpass.quant.groups import group_amax
from qpass.quant.nvfp4 import nvfp4_quantize

from qpass.passes.common import aten_linear_nodes, bias_arg, copy_meta, grouped, selected

ACT_SPECS = {"nvfp4": NVFP4_ACT.key, "nvfp4_per_token": NVFP4_ACT_PER_TOKEN.key, "none": None}


def constant_names(site_id: str) -> tuple[str, str, str, str]:
    """Buffer names of a site's codes, scale bytes, S_dec (read by the op) and S_enc (exported only)."""
    base = re.sub(r"[^0-9a-zA-Z_]", "_", "qpass_w__" + site_id)
    return base + "__codes", base + "__scales", base + "__s_dec", base + "__s_enc"


def quantize_site_weights(weights: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, object]:
    """Quantize one fused group's weights with a shared amax (site id -> NVFP4Tensor)."""
    amax = group_amax(list(weights.values()))
    return {sid: nvfp4_quantize(w, amax, spec=NVFP4_WEIGHT, name=names[sid], site=sid) for sid, w in weights.items()}


class NVFP4LowerOptions(PassOptions):
    act: Literal["nvfp4", "nvfp4_per_token", "none"] = "nvfp4"


class W4A16LowerOptions(NVFP4LowerOptions):
    act: Literal["nvfp4", "nvfp4_per_token", "none"] = "none"


class _NVFP4Lower(Pass):
    sides = ("rollout",)
    requires = ("sites_stamped",)
    ensures = ("nvfp4_lowered",)

    def run(self, qg: QGraph, ctx: PassContext) -> PassResult:
        res = PassResult(self.name, qg.side)
        sites, res.skipped = selected(qg, self.options, need_nvfp4=True)
        g = qg.gm.graph
        act = self.options.act
        for gid, members in grouped(sites).items():
            nodes = {s.id: aten_linear_nodes(qg, s.id) for s in members}
            for s in members:
                if not nodes[s.id]:
                    res.skipped.append((s.id, "no unrewritten aten.linear node (already lowered?)"))
            members = [s for s in members if nodes[s.id]]
            if not members:
                continue
            weights = {s.id: qg.attr(str(nodes[s.id][0].args[1].target)).detach() for s in members}
            quantized = quantize_site_weights(weights, {s.id: s.weight for s in members})
            for s in members:
                q = quantized[s.id]
                first = nodes[s.id][0]
                cn, sn, dn, en = constant_names(s.id)
                qg.gm.register_buffer(en, q.s_enc)  # not read by the graph; exported as weight_global_scale
                consts = [qg.add_constant(cn, q.codes, before=first), qg.add_constant(sn, q.scales, before=first),
                          qg.add_constant(dn, q.s_dec, before=first)]
                for lin in nodes[s.id]:
                    with g.inserting_before(lin):
                        new = g.call_function(
                            torch.ops.qpass.nvfp4_linear.default,
                            (lin.args[0], *consts, bias_arg(lin), s.id, act, 0.0, "masked", "batch", None),
                        )
                    copy_meta(lin, new)
                    lin.replace_all_uses_with(new)
                    g.erase_node(lin)
                qg.quant[s.id] = {
                    "kind": "nvfp4_linear", "spec": NVFP4_WEIGHT.key, "act_spec": ACT_SPECS[act], "group": gid,
                    "members": [m.id for m in members], "weight": s.weight,
                    "constants": {"codes": consts[0].target, "scales": consts[1].target, "s_dec": consts[2].target, "s_enc": en},
                }
                res.sites.append(s.id)
        res.matches = len(res.sites)
        res.changed = res.matches > 0
        res.details["removed_params"] = len(qg.prune())
        return res


@register_pass
class W4A4Lower(_NVFP4Lower):
    """NVFP4 weights + dynamically quantized NVFP4 activations (act: nvfp4 | nvfp4_per_token | none)."""

    name = "w4a4_lower"
    Options = NVFP4LowerOptions


@register_pass
class W4A16Lower(_NVFP4Lower):
    """NVFP4 weights, BF16 activations (``w4a4_lower`` with ``act: none``)."""

    name = "w4a16_lower"
    Options = W4A16LowerOptions
