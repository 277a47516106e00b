"""qpass's learner recipe on a Megatron-core model: which ``linear_*`` modules are fake-quantized,
and the per-HF-site view of what they compute.

The recipe is resolved by qpass itself (its learner graph's :class:`qpass.graph.records.SiteQuant`
records: site ids, fused groups, which weights ``weight_qdq`` fake-quantizes); this module maps
that onto Megatron's fusion. A fused Megatron module (``linear_qkv`` = q/k/v, ``linear_fc1`` =
gate/up) is patched when every HF member is fake-quantized *and* qpass groups them the same way
(one shared amax on both sides); anything else is refused, as is a learner-side activation QDQ
(the backend implements ``weight_qdq``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qpass.backends.megatron.config import LlamaLayout
from qpass.backends.megatron.convert import hf_site_groups, merge_rows
from qpass.errors import QpassError

__all__ = ["fake_quant_plan", "split_to_sites"]


def fake_quant_plan(records: Mapping[str, object], layout: LlamaLayout) -> dict[str, tuple[str, ...]]:
    """``{Megatron linear module: HF site ids}`` to fake-quantize, from a learner graph's ``quant``.

    Args:
        records: ``QGraph.quant`` of qpass's learner graph for the same model and recipe
            (``SiteQuant`` per site id).
        layout: the model's :class:`~qpass.backends.megatron.config.LlamaLayout`.
    Returns:
        the modules to patch (empty for a recipe without learner weight QDQ, e.g. ``bf16``).
    Raises:
        QpassError: a learner site quantizes activations, a site is not a decoder linear of the
            model, or a fused Megatron module is only partly fake-quantized / grouped differently.
    """
    fq = {sid: r for sid, r in records.items() if getattr(r, "weight_fake_quant", False)}
    acts = sorted(sid for sid, r in records.items() if getattr(r, "act_spec", None) is not None)
    if acts:
        raise QpassError(f"the Megatron learner implements weight_qdq only; the recipe's learner also quantizes "
                         f"activations at {len(acts)} site(s), e.g. {acts[0]}")
    plan: dict[str, tuple[str, ...]] = {}
    covered: set[str] = set()
    for module, (kind, sites) in hf_site_groups(layout).items():
        on = [s for s in sites if s in fq]
        covered.update(sites)
        if not on:
            continue
        if len(on) != len(sites):
            raise QpassError(f"{module} fuses {', '.join(sites)}; the recipe fake-quantizes only {', '.join(on)}")
        groups = {fq[s].group for s in sites}
        members = set(fq[sites[0]].members)
        if len(groups) != 1 or members != set(sites):
            raise QpassError(f"{module} fuses {', '.join(sites)} under one amax; qpass groups them as "
                             f"{sorted(groups)} with members {sorted(members)}")
        plan[module] = sites
    stray = sorted(set(fq) - covered)
    if stray:
        raise QpassError(f"learner site {stray[0]} is not a decoder linear of the Megatron model (e.g. lm_head is "
                         f"not fake-quantized by this backend)")
    return plan


def split_to_sites(kind: str, gathered: torch.Tensor, sites: tuple[str, ...], layout: LlamaLayout) -> dict[str, torch.Tensor]:
    """A TP-gathered Megatron tensor (weight, ``W_hat``, NVFP4 codes or scale bytes of one module;
    column-parallel modules gathered along dim 0, row-parallel ones along K) split into its HF
    sites (the row mapping of :func:`qpass.backends.megatron.convert.merge_rows`)."""
    if kind == "cols":
        return {sites[0]: gathered}
    parts = merge_rows(kind, gathered.chunk(layout.tp, dim=0), layout)
    return dict(zip(sites, parts))
