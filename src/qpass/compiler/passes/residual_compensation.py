"""``residual_compensation`` (rollout): RAC on the input of targeted W4A4 linears (SPEC §2).

Rewrites the arguments of existing ``qpass.nvfp4_linear`` nodes (it requires ``nvfp4_lowered``)::

    qpass.nvfp4_linear(x, ..., act="nvfp4", rac_ratio=0.0, ...)
      -> qpass.nvfp4_linear(x, ..., act="nvfp4", rac_ratio=0.5, rac_mode="masked", rac_selection="batch", None)

``selection: static`` asks the pass context's calibration (:mod:`qpass.calibration.source`: a
verified ``qpass calibrate`` file, or calibration activations) for each site's channels — the
top-k of the exact integer residual score over all calibration tokens,
:func:`qpass.quant.rac.static_channels` — and stores them as an int64 constant ``rac_channels``.
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
from qpass.compiler.manager import Cleanup, Pass, PassContext, PassOptions, Rewrites, register_pass
from qpass.quant.rac import RACConfig

from qpass.compiler.passes._common import selected


class RACOptions(PassOptions):
    targets: list[str] = ["*.mlp.gate_proj", "*.mlp.up_proj"]
    ratio: float = pydantic.Field(0.5, ge=0.0, le=1.0)
    mode: Literal["masked", "gathered"] = "masked"
    selection: Literal["batch", "token", "static"] = "batch"
    # a ratio that selects 0 channels (floor(ratio * K) == 0) on every targeted site is an error
    # unless this is set (the study's zero-channel invariant: such RAC must equal plain W4A4)
    allow_zero_channels: bool = False


@register_pass
class ResidualCompensation(Pass):
    """Enable residual activation compensation on targeted W4A4 sites."""

    name = "residual_compensation"
    Options = RACOptions
    sides = ("rollout",)
    requires = ("nvfp4_lowered",)
    ensures = ("rac",)
    mutation = "in_place"
    cleanup = Cleanup.TIDY  # the manager lints and recompiles after the rewrite

    def run(self, qg: QGraph, ctx: PassContext) -> Rewrites:
        o = self.options
        sites, skipped = selected(qg, o, need_nvfp4=True)
        out = Rewrites(skipped=skipped)
        op = NVFP4_LINEAR.overload()
        rac = RACConfig(float(o.ratio), o.mode, o.selection)
        todo: dict[str, list[torch.fx.Node]] = {}
        acts: dict[str, NVFP4Spec] = {}
        zero: list[str] = []
        for s in sites:
            nodes = [n for n in qg.nodes_of_site(s.id) if n.target == op]
            act = NVFP4LinearCall.decode(op_args(nodes[0]), s.id)[0] if nodes else None
            if not nodes:
                out.skip(s.id, "not lowered to qpass.nvfp4_linear")
            elif act is None or any(NVFP4LinearCall.decode(op_args(n), s.id)[0] is None for n in nodes):
                out.skip(s.id, "W4A16 site: its activations are not quantized, nothing to compensate")
            elif rac.num_channels(s.in_features) == 0 and not o.allow_zero_channels:
                zero.append(s.id)
                out.skip(s.id, f"ratio {o.ratio} of in_features={s.in_features} selects 0 channels")
            else:
                todo[s.id] = nodes
                acts[s.id] = act
        if zero and not todo:
            raise PassError(
                f"residual_compensation: ratio {o.ratio} selects 0 channels on every targeted site "
                f"({len(zero)}: {zero[:4]}{' ...' if len(zero) > 4 else ''}); use a ratio >= 1/in_features, drop the pass, "
                "or set allow_zero_channels: true"
            )
        calib = self._static_channels(qg, todo, ctx) if o.selection == "static" and todo else {}
        for sid, nodes in todo.items():
            ch_node = None
            if o.selection == "static":
                ch_node = qg.add_constant("qpass_rac__" + sid + "__channels", calib[sid], before=nodes[0])
            for n in nodes:
                set_op_args(n, **NVFP4LinearCall.encode(acts[sid], rac), rac_channels=ch_node)
            qg.quant[sid] = dataclasses.replace(qg.quant[sid], rac=rac)
            out.rewrote(sid)
        return out

    def _static_channels(self, qg: QGraph, todo: dict[str, list[torch.fx.Node]], ctx: PassContext) -> dict[str, torch.Tensor]:
        """The calibrated channels of every site in ``todo`` (int64 ``[k]``, sorted), checked.

        Raises:
            PassError: no calibration in the context (says how to get one); channels of another
                count, unsorted or out of range (names the site and the source).
        """
        from qpass.calibration.source import RACRequest

        if ctx.calibration is None:
            raise PassError("residual_compensation with selection: static needs calibrated channels; run "
                            "`qpass calibrate RECIPE --out CAL` and pass --calibration CAL")
        reqs = []
        for sid, nodes in todo.items():
            a = op_args(nodes[0])
            amax = qg.gm.get_buffer(str(a["act_amax"].target)).detach().clone() if isinstance(a["act_amax"], torch.fx.Node) else None
            reqs.append(RACRequest(sid, float(self.options.ratio), a["act"], qg.sites[sid].in_features, amax))
        got = ctx.calibration.rac_channels(reqs)
        out = {}
        for r in reqs:
            ch = got.get(r.site)
            if ch is None:
                raise PassError(f"{ctx.calibration.name}: no static RAC channels for site {r.site}")
            ch = ch.detach().to(torch.int64).cpu().reshape(-1).clone()
            ok = ch.numel() == r.k and bool((ch[1:] > ch[:-1]).all()) and (ch.numel() == 0 or (0 <= int(ch[0]) and int(ch[-1]) < r.in_features))
            if not ok:
                raise PassError(f"{ctx.calibration.name}: site {r.site}: static RAC channels must be {r.k} distinct sorted "
                                f"ids in [0, {r.in_features}), got {ch.numel()}: {ch[:8].tolist()}")
            out[r.site] = ch
        return out
