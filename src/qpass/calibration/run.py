"""Compute a calibration, re-calibrate a rollout graph in place, and how stale its static scales are.

* :func:`calibrate` — the core of ``qpass calibrate``: the input amax of every linear site of the
  model (one sweep over the calibration tokens), then the recipe's rollout side is built with an
  :class:`~qpass.calibration.source.ActivationSource`, so the calibrating passes ask for exactly what
  they need (static RAC sites: one more sweep keeping their input rows) and compute it with the
  functions they would use on any data (:func:`qpass.quant.rac.static_channels`); the answers and
  every site's amax become the :class:`~qpass.calibration.record.Calibration`.
* :func:`graph_requests` — what a built rollout graph holds from a calibration (its ``act_amax`` and
  static ``rac_channels`` constants), for checks and :func:`recalibrate`.
* :func:`recalibrate` — recompute those constants from a model (e.g. the learner's masters after a
  GRPO weight sync) on the calibration tokens and write them into the graph in place.
* :func:`staleness` — the amax the rollout saw (:mod:`qpass.quant.observe`) against the calibrated one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qpass.calibration.measure import fill_unreached_experts, model_fingerprint, site_inputs
from qpass.calibration.record import Calibration, RACEntry, tokens_sha256
from qpass.calibration.source import ActivationSource, AmaxRequest, CalibrationError, RACRequest

__all__ = ["GraphRequests", "calibrate", "graph_requests", "recalibrate", "staleness"]


def calibrate(pipeline: Any, recipe: Any, token_ids: Sequence[Sequence[int]], *, data: Mapping[str, Any],
              model_ref: str, qpass_version: str = "") -> Calibration:
    """Calibrate ``recipe``'s rollout on ``pipeline``'s model (module docstring).

    Args:
        pipeline: a :class:`qpass.compiler.pipeline.Pipeline` (its loaded model is run, its step graph gives
            the sites and fused groups; any batch size / KV length).
        recipe: a :class:`qpass.compiler.recipe.Recipe`.
        token_ids: the calibration prompts as token ids (one forward each).
        data: what the tokens are (``source``, ``prompts_sha256``, ...; counts and the tokens' sha256
            are added here).
        model_ref: the model reference the user gave (recorded).
    Returns:
        the calibration (in memory; :meth:`Calibration.write` saves it).
    Raises:
        CalibrationError: no or empty prompts; a site no calibration token reached that a
            calibrating pass needs; a non-finite activation. RecipeError / PassError: see
            :meth:`qpass.compiler.pipeline.Pipeline.build_side`.
    """
    model = pipeline.loaded.model
    sites = {s: st for s, st in pipeline.base_step.sites.items() if st.nvfp4_ok}
    ids = [tuple(int(i) for i in t) for t in token_ids]
    amax, _ = site_inputs(model, sites, ids)
    amax, unreached = fill_unreached_experts(amax, sites)
    src = ActivationSource(lambda req: site_inputs(model, [], ids, keep=req)[1], amax=amax,
                           name=f"calibration of recipe {recipe.name!r}")
    pipeline.build_side(recipe, "rollout", share_params=True, calibration=src, debug=False, kernels="reference")
    rac = {s: RACEntry(r.ratio, r.act, r.in_features, ch, scores, r.act_amax) for s, (r, ch, scores) in sorted(src.served_rac.items())}
    lengths = [len(t) for t in ids]
    meta = {
        "qpass_version": qpass_version,
        "data": {**dict(data), "prompts": len(ids), "tokens": sum(lengths), "tokens_per_prompt": lengths,
                 "tokens_sha256": tokens_sha256(ids), "experts_not_reached": sorted(unreached),
                 "sites_not_reached": sorted(set(sites) - set(amax))},
        "model": {"ref": model_ref, "name": pipeline.loaded.name, "source": str(pipeline.loaded.source),
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "weights_sha256": model_fingerprint(model)},
        "recipe": {"name": recipe.name, "sha256": hashlib.sha256((recipe.text or "").encode()).hexdigest(), "text": recipe.text,
                   "static_act_sites": len(src.served_amax), "static_rac_sites": len(rac)},
    }
    kept = sorted(amax)
    return Calibration({s: amax[s].float().reshape(()).clone() for s in kept}, {s: sites[s].group for s in kept},
                       {s: sites[s].in_features for s in kept}, rac, tuple(ids), meta)


def prompts_sha256(texts: Sequence[str]) -> str:
    """sha256 of the prompt texts as canonical JSON (a list of strings)."""
    return hashlib.sha256(json.dumps(list(texts), ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


# ----------------------------------------------------------------------------- a built rollout graph


@dataclasses.dataclass(frozen=True)
class GraphRequests:
    """The calibrated constants of a rollout graph.

    Attributes:
        amax: static-activation sites: request and the ``act_amax`` buffer names of its nodes.
        rac: static-RAC sites: (ratio, act, K) and the ``rac_channels`` buffer names of its nodes.
    """

    amax: dict[str, tuple[AmaxRequest, tuple[str, ...]]]
    rac: dict[str, tuple[float, str, int, tuple[str, ...]]]

    def __bool__(self) -> bool:
        return bool(self.amax or self.rac)


def graph_requests(rollout: Any) -> GraphRequests:
    """Read the ``act_amax`` / static ``rac_channels`` constants of every ``qpass::nvfp4_linear`` node."""
    from qpass.graph.opargs import op_args

    op = torch.ops.qpass.nvfp4_linear.default
    amax: dict[str, tuple[AmaxRequest, list[str]]] = {}
    rac: dict[str, tuple[float, str, int, list[str]]] = {}
    for n in rollout.gm.graph.nodes:
        if n.op != "call_function" or n.target != op:
            continue
        a = op_args(n)
        site = a["site"]
        k = rollout.sites[site].in_features
        if isinstance(a["act_amax"], torch.fx.Node):
            req = AmaxRequest(site, rollout.quant[site].group, k)
            amax.setdefault(site, (req, []))[1].append(str(a["act_amax"].target))
        if a["rac_selection"] == "static" and float(a["rac_ratio"]) > 0 and isinstance(a["rac_channels"], torch.fx.Node):
            rac.setdefault(site, (float(a["rac_ratio"]), a["act"], k, []))[3].append(str(a["rac_channels"].target))
    return GraphRequests({s: (r, tuple(b)) for s, (r, b) in amax.items()},
                         {s: (ratio, act, k, tuple(b)) for s, (ratio, act, k, b) in rac.items()})


def graph_constants(rollout: Any, req: GraphRequests | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``({site: act_amax}, {site: rac_channels})`` the graph uses now (each site's first node)."""
    req = req or graph_requests(rollout)
    amax = {s: rollout.gm.get_buffer(b[0]).detach().clone() for s, (_, b) in req.amax.items()}
    ch = {s: rollout.gm.get_buffer(b[-1]).detach().clone() for s, (*_, b) in req.rac.items()}
    return amax, ch


@torch.no_grad()
def recalibrate(rollout: Any, model: torch.nn.Module, token_ids: Sequence[Sequence[int]],
                sites: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Recompute the graph's calibrated constants from ``model`` on ``token_ids`` and write them in place.

    The amax first (every site of ``sites``, default the graph's sites; static-activation sites get
    their group's new amax), then the static RAC channels, scored under the new amax.

    Args:
        rollout: a rollout :class:`~qpass.graph.qgraph.QGraph` (constants are overwritten with ``copy_``,
            so a captured CUDA graph stays valid).
        model: the unquantized HF model at the weights to calibrate for.
    Returns:
        ``{"amax": {site: new group-or-own amax (float32 0-d)}, "amax_change_max": max |new/old - 1| over
        the static-activation sites (None: none), "rac_channels_changed": changed fraction of the static
        channel slots (None: none), "rac_sites": n, "static_act_sites": n}``.
    Raises:
        CalibrationError: as :func:`calibrate`.
    """
    req = graph_requests(rollout)
    modules = dict(model.named_modules())
    all_sites = [s for s in (sites or rollout.sites) if isinstance(modules.get(s), torch.nn.Linear)]
    amax, rows = site_inputs(model, all_sites, token_ids, keep=list(req.rac))
    amax, _ = fill_unreached_experts(amax, all_sites)
    src = ActivationSource(rows, amax=amax, name="GRPO re-calibration")
    out: dict[str, Any] = {"static_act_sites": len(req.amax), "rac_sites": len(req.rac), "amax_change_max": None,
                           "rac_channels_changed": None}
    if req.amax:
        new = src.input_amax([r for r, _ in req.amax.values()])
        changes = []
        for s, (_, bufs) in req.amax.items():
            old = float(rollout.gm.get_buffer(bufs[0]))
            changes.append(abs(float(new[s]) / old - 1.0) if old > 0 else float("inf"))
            for b in bufs:
                buf = rollout.gm.get_buffer(b)
                buf.copy_(new[s].to(buf.device))
        out["amax_change_max"] = max(changes)
    if req.rac:
        reqs = [RACRequest(s, ratio, act, k, rollout.gm.get_buffer(req.amax[s][1][0]).detach().cpu().clone() if s in req.amax else None)
                for s, (ratio, act, k, _) in req.rac.items()]
        got = src.rac_channels(reqs)
        slots = changed = 0
        for s, (*_, bufs) in req.rac.items():
            for b in bufs:
                buf = rollout.gm.get_buffer(b)
                slots += buf.numel()
                changed += int((~torch.isin(got[s].to(buf.device), buf)).sum())
                buf.copy_(got[s].to(buf.device))
        out["rac_channels_changed"] = changed / slots if slots else 0.0
    out["amax"] = dict(amax)
    out["group_amax"] = _group_amax(amax, rollout)
    return out


def _group_amax(amax: Mapping[str, torch.Tensor], rollout: Any) -> dict[str, torch.Tensor]:
    groups = {s: rollout.sites[s].group for s in amax if s in rollout.sites}
    g: dict[str, torch.Tensor] = {}
    for s, gid in groups.items():
        g[gid] = amax[s] if gid not in g else torch.maximum(g[gid], amax[s])
    return {s: g[gid] for s, gid in groups.items()}


def load_masters(model: torch.nn.Module, masters: Mapping[str, torch.Tensor]) -> int:
    """Copy master weights (HF names) into ``model``'s parameters in place. Returns how many were copied.

    Raises:
        CalibrationError: a parameter of ``model`` none of whose names (tied aliases) ``masters`` has.
    """
    names: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    n = 0
    with torch.no_grad():
        for pid, p in params.items():
            src = next((masters[k] for k in names[pid] if k in masters), None)
            if src is None:
                raise CalibrationError(f"re-calibration: the master weights lack {names[pid][0]}")
            p.copy_(src.to(device=p.device, dtype=p.dtype))
            n += 1
    return n


# ----------------------------------------------------------------------------- staleness


def staleness(observed: Mapping[str, torch.Tensor], calibrated: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """How far the rollout's activations are from the calibrated amax, per site ``observed / calibrated``.

    A ratio above 1 means the input exceeded the calibrated range: a static scale saturates there
    (block scales at 448, elements at ±6); far below 1 wastes E4M3 range.

    Args:
        observed: per site the amax the rollout saw (:class:`qpass.quant.observe.AmaxTape`).
        calibrated: per site the calibrated (group) amax in effect.
    Returns:
        ``{"sites": n, "ratio_max", "ratio_median", "ratio_min", "sites_over": n with ratio > 1,
        "worst_site"}`` (ratios ``None`` when no site was both observed and calibrated).
    """
    ratios = {s: float(observed[s]) / float(calibrated[s]) for s in observed if s in calibrated and float(calibrated[s]) > 0}
    if not ratios:
        return {"sites": 0, "ratio_max": None, "ratio_median": None, "ratio_min": None, "sites_over": 0, "worst_site": None}
    worst = max(ratios, key=lambda s: ratios[s])
    vals = list(ratios.values())
    return {"sites": len(vals), "ratio_max": max(vals), "ratio_median": statistics.median(vals), "ratio_min": min(vals),
            "sites_over": sum(v > 1.0 for v in vals), "worst_site": worst}
