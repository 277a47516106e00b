"""``residual_compensation`` (rollout): RAC on the input of targeted W4A4 linears (SPEC §2).

Rewrites the arguments of existing ``qpass.nvfp4_linear`` nodes (it requires ``nvfp4_lowered``)::

    qpass.nvfp4_linear(x, ..., act="nvfp4", rac_ratio=0.0, ...)
      -> qpass.nvfp4_linear(x, ..., act="nvfp4", rac_ratio=0.5, rac_mode="masked", rac_selection="batch", None)

``selection: static`` calibrates: it runs the calibration inputs the caller provides through the
graph, scores the channels of each site's residual over all calibration tokens with the exact
integer score of :mod:`qpass.quant.rac`, and stores the top-k channels as an int64 constant.
QUADS applies k = 50% on the gate/up input (the default targets).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import pydantic
import torch

from qpass.errors import PassError
from qpass.formats.spec import NVFP4Spec
from qpass.ops import NVFP4_LINEAR, NVFP4LinearCall
from qpass.graph.opargs import op_args, set_op_args
from qpass.graph.qgraph import QGraph
from qpass.pm import Pass, PassContext, PassOptions, PassResult, register_pass
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from qpass.quant.rac import RACConfig, channel_scores, topk_channels

from qpass.passes.common import finish, selected


class RACOptions(PassOptions):
    targets: list[str] = ["*.mlp.gate_proj", "*.mlp.up_proj"]
    ratio: float = pydantic.Field(0.5, ge=0.0, le=1.0)
    mode: Literal["masked", "gathered"] = "masked"
    selection: Literal["batch", "token", "static"] = "batch"
    # a ratio that selects 0 channels (floor(ratio * K) == 0) on every targeted site is an error
    # unless this is set (the study's zero-channel invariant: such RAC must equal plain W4A4)
    allow_zero_channels: bool = False


def static_channels(x: torch.Tensor, act: NVFP4Spec, rac: RACConfig) -> torch.Tensor:
    """Calibrated RAC channels of activations ``x`` [M, K] quantized as ``act``: the exact top-k
    (``rac.num_channels(K)``) residual energy."""
    q = nvfp4_quantize(x, spec=act)
    r = x.float() - nvfp4_dequantize(q, torch.bfloat16).float()
    return topk_channels(channel_scores(r, q.amax.amax()), rac.num_channels(x.shape[-1]))


@register_pass
class ResidualCompensation(Pass):
    """Enable residual activation compensation on targeted W4A4 sites."""

    name = "residual_compensation"
    Options = RACOptions
    sides = ("rollout",)
    requires = ("nvfp4_lowered",)
    ensures = ("rac",)

    def run(self, qg: QGraph, ctx: PassContext) -> PassResult:
        o = self.options
        res = PassResult(self.name, qg.side)
        sites, res.skipped = selected(qg, o, need_nvfp4=True)
        op = NVFP4_LINEAR.overload()
        rac = RACConfig(float(o.ratio), o.mode, o.selection)
        todo: dict[str, list[torch.fx.Node]] = {}
        acts: dict[str, NVFP4Spec] = {}
        zero: list[str] = []
        for s in sites:
            nodes = [n for n in qg.nodes_of_site(s.id) if n.target == op]
            act = NVFP4LinearCall.decode(op_args(nodes[0]), s.id)[0] if nodes else None
            if not nodes:
                res.skipped.append((s.id, "not lowered to qpass.nvfp4_linear"))
            elif act is None or any(NVFP4LinearCall.decode(op_args(n), s.id)[0] is None for n in nodes):
                res.skipped.append((s.id, "W4A16 site: its activations are not quantized, nothing to compensate"))
            elif rac.num_channels(s.in_features) == 0 and not o.allow_zero_channels:
                zero.append(s.id)
                res.skipped.append((s.id, f"ratio {o.ratio} of in_features={s.in_features} selects 0 channels"))
            else:
                todo[s.id] = nodes
                acts[s.id] = act
        if zero and not todo:
            raise PassError(
                f"residual_compensation: ratio {o.ratio} selects 0 channels on every targeted site "
                f"({len(zero)}: {zero[:4]}{' ...' if len(zero) > 4 else ''}); use a ratio >= 1/in_features, drop the pass, "
                "or set allow_zero_channels: true"
            )
        calib = {}
        if o.selection == "static" and todo:
            if ctx.calibration is None:
                raise PassError("residual_compensation with selection: static needs calibration inputs (none given)")
            calib = ctx.calibration(qg, list(todo))
        for sid, nodes in todo.items():
            ch_node = None
            if o.selection == "static":
                if sid not in calib:
                    raise PassError(f"calibration produced no activations for site {sid}")
                ch = static_channels(calib[sid], acts[sid], rac)
                ch_node = qg.add_constant("qpass_rac__" + sid + "__channels", ch, before=nodes[0])
            for n in nodes:
                set_op_args(n, **NVFP4LinearCall.encode(acts[sid], rac), rac_channels=ch_node)
            qg.quant[sid] = dataclasses.replace(qg.quant[sid], rac=rac)
            res.sites.append(sid)
        res.matches = len(res.sites)
        res.changed = res.matches > 0
        finish(qg)
        return res
