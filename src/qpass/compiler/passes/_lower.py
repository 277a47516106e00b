"""Generic linear lowering (rollout): ``aten.linear(x, w)`` -> the rollout op of the weight spec.

Shared by the four lowering passes, each in the file of its recipe word (``w4a4_lower.py``,
``w4a16_lower.py``, ``fp8_lower.py``, ``mxfp4_lower.py``). One pass body for every format; what it emits comes from the spec tables (:mod:`qpass.tables`):
the ``rollout_lower`` entry of the weight spec gives the op schema, its constants and (through the
op's typed call class, :mod:`qpass.ops.calls`) the option arguments,
and :func:`qpass.quant.weights.quantize_site_weights` the constants (one shared amax per fused group
for specs with a global scale, SPEC §3 rule 1). The recipe passes are thin configurations:

* ``w4a4_lower`` (``act``: an NVFP4 activation mode, ``qpass.formats.spec.NVFP4_ACT_MODES``;
  ``act_scale``: dynamic | static) and
  ``w4a16_lower`` (``act: none``)::

      y = aten.linear(x, get_attr[model.layers.0.mlp.down_proj.weight])
   -> y = qpass.nvfp4_linear(x, codes, scales, s_dec, None, "model.layers.0.mlp.down_proj",
                             act="nvfp4", rac_ratio=0.0, rac_mode="masked", rac_selection="batch", None)

  ``act_scale: static`` (with ``act: nvfp4``) takes each fused group's calibrated input amax from the
  pass context's calibration (``qpass calibrate``; ``--calibration CAL``) instead of the amax of each
  input: ``act="nvfp4_static"`` and one float32 0-d constant ``act_amax`` per site (bit-identical
  within a fused group), SPEC §3 arithmetic with that global scale (ModelOpt's static ``input_scale``).

* ``fp8_lower`` (``act_granularity``, ``weight_granularity``): ``qpass.fp8_linear(x, w_fp8, w_scale,
  bias, site, act_granularity, w_granularity)`` (DeepSeek-style blocks by default).
* ``mxfp4_lower``: ``qpass.mxfp4_linear(x, codes, e8m0_scales, bias, site)`` (weight-only, K % 32).

The BF16 weight is dropped from the rollout graph (the pass declares ``Cleanup.PRUNE``: the manager
eliminates dead code and drops the unread parameters, ``details["removed_params"]``); each site gets a :class:`qpass.graph.records.SiteQuant`
record. ``details["flushed_blocks"]`` counts, per site, the non-zero weight blocks whose block scale
underflowed to 0 (they decode to zero under the SPEC §3 keep-zero rule).
"""

from __future__ import annotations

import re
from typing import Literal

import pydantic

from qpass import ops  # noqa: F401 - registers the rollout ops and their table entries
from qpass.formats.spec import NVFP4ActMode, QuantSpec, nvfp4_act_spec_of, nvfp4_weight_spec
from qpass.graph.opargs import args_in_schema_order
from qpass.graph.qgraph import QGraph
from qpass.graph.records import SiteQuant
from qpass.errors import PassError
from qpass.compiler.manager import Cleanup, Pass, PassContext, PassOptions, Rewrites
from qpass.progress import track
from qpass.quant.weights import quantize_site_weights
from qpass.tables import entry

from qpass.compiler.passes._common import bias_arg, copy_meta, grouped, k_aligned, selected, with_linear_nodes


def constant_name(site_id: str, name: str) -> str:
    """Buffer name of a site's constant ``name`` (``qpass_w__model_layers_0_..._q_proj__codes``)."""
    return re.sub(r"[^0-9a-zA-Z_]", "_", f"qpass_w__{site_id}") + f"__{name}"


class LinearLower(Pass):
    """Replace targeted linears by the rollout op of :meth:`specs` (subclasses configure it)."""

    sides = ("rollout",)
    requires = ("sites_stamped",)
    mutation = "in_place"
    cleanup = Cleanup.PRUNE  # the manager drops the BF16 weights no node reads any more

    def specs(self) -> tuple[QuantSpec, QuantSpec | None]:  # pragma: no cover - abstract
        """``(weight spec, activation spec or None)`` from the options."""
        raise NotImplementedError

    def run(self, qg: QGraph, ctx: PassContext) -> Rewrites:
        wspec, aspec = self.specs()
        lo = entry("rollout_lower", wspec)
        op = lo.op_overload()
        sites, skipped = selected(qg, self.options)
        out = Rewrites(skipped=skipped)
        ok = k_aligned(sites, lo.k_multiple, out)
        groups = grouped(ok) if wspec.has_global_scale else {s.id: [s] for s in ok}
        act_amax = self._static_amax(groups, aspec, ctx)
        g = qg.gm.graph
        flushed: dict[str, int] = {}
        for gid, members in track(groups.items(), f"{self.name}: quantize and lower", unit="group"):
            members, nodes = with_linear_nodes(qg, members, out, "lowered")
            if not members:
                continue
            weights = {s.id: qg.attr(str(nodes[s.id][0].args[1].target)).detach() for s in members}
            quantized = quantize_site_weights(wspec, weights, names={s.id: s.weight for s in members})
            for s in members:
                sw = quantized[s.id]
                first = nodes[s.id][0]
                names, arg_nodes = {}, {}
                for cname, value in sw.constants.items():
                    attr = constant_name(s.id, cname)
                    if cname in lo.constant_args:
                        arg_nodes[lo.constant_args[cname]] = qg.add_constant(attr, value, before=first)
                    else:  # kept (exported), never read by the op
                        qg.gm.register_buffer(attr, value)
                    names[cname] = attr
                if s.id in act_amax:
                    arg_nodes["act_amax"] = qg.add_constant(constant_name(s.id, "act_amax"), act_amax[s.id], before=first)
                fixed = {**lo.option_args(wspec, aspec, s.id), **arg_nodes, "site": s.id}
                for lin in nodes[s.id]:
                    args = args_in_schema_order(op, {"x": lin.args[0], "bias": bias_arg(lin), **fixed})
                    with g.inserting_before(lin):
                        new = g.call_function(op, args)
                    copy_meta(lin, new)
                    lin.replace_all_uses_with(new)
                    g.erase_node(lin)
                qg.quant[s.id] = SiteQuant(
                    site=s.id, weight=s.weight, group=gid, members=tuple(m.id for m in members), spec=wspec,
                    act_spec=aspec, op=lo.op, constants=names, flushed_blocks=sw.flushed_blocks,
                )
                if sw.flushed_blocks:
                    flushed[s.id] = sw.flushed_blocks
                out.rewrote(s.id)
        out.details["flushed_blocks"] = flushed
        if act_amax:
            out.details["static_act_sites"] = len(act_amax)
        return out

    def _static_amax(self, groups: dict, aspec: QuantSpec | None, ctx: PassContext) -> dict:
        """``{site: float32 0-d calibrated group amax}`` for a static activation spec (else empty).

        Raises:
            PassError: no calibration in the context (says how to get one).
        """
        if aspec is None or getattr(aspec, "global_source", "dynamic") != "static" or not groups:
            return {}
        from qpass.calibration.source import AmaxRequest

        if ctx.calibration is None:
            raise PassError(f"{self.name} with act_scale: static needs calibrated input scales; run "
                            "`qpass calibrate RECIPE --out CAL` and pass --calibration CAL")
        reqs = [AmaxRequest(s.id, gid, s.in_features) for gid, members in groups.items() for s in members]
        got = ctx.calibration.input_amax(reqs)
        return {r.site: got[r.site].detach().float().reshape(()).clone() for r in reqs}


class NVFP4LowerOptions(PassOptions):
    act: NVFP4ActMode = "nvfp4"  # qpass.formats.spec.NVFP4_ACT_MODES
    arithmetic: Literal["te_reference", "modelopt"] = "te_reference"  # weight quantizer (NVFP4Spec.arithmetic); match weight_qdq
    # activation global scale: the amax of each input (SPEC §3 rule 5) or a calibrated one (qpass calibrate)
    act_scale: Literal["dynamic", "static"] = "dynamic"

    @pydantic.model_validator(mode="after")
    def _static_needs_per_tensor(self) -> "NVFP4LowerOptions":
        if self.act_scale == "static" and self.act != "nvfp4":
            raise ValueError(f"act_scale: static needs act: nvfp4 (a calibrated per-tensor input scale), got act: {self.act}")
        return self




class NVFP4Lower(LinearLower):
    """The NVFP4 lowerings (``w4a4_lower``, ``w4a16_lower``): the weight spec from ``arithmetic``,
    the activation spec from ``act`` / ``act_scale``."""

    ensures = ("nvfp4_lowered",)

    def specs(self) -> tuple[QuantSpec, QuantSpec | None]:
        # act_scale: static (validated: with act: nvfp4 only) is the op's calibrated mode
        static = getattr(self.options, "act_scale", "dynamic") == "static"
        return nvfp4_weight_spec(self.options.arithmetic), nvfp4_act_spec_of("nvfp4_static" if static else self.options.act, self.name)
