"""Static activation scales for W4A4 checkpoints: ``input_scale`` calibrated on prompts.

qpass quantizes activations dynamically (SPEC §3 rule 5), so its own plugins ignore
``input_scale``; a W4A4 consumer with static activation scales (vLLM's and SGLang's
``modelopt_fp4``) reads one per linear and needs it shared within a fused group (one GEMM input).
ModelOpt's NVFP4 activation decode scale is ``amax / (6 * 448)`` (a decode **multiplier**, float32),
``amax`` the max |x| of the linear's input over the calibration tokens.

Source: prior-art/nvfp4_semantics.md ("ModelOpt export" row: ``input_scale = amax / (maxbound * 448)``,
``maxbound = 6``; fused q/k/v and gate/up take the max of their input amaxes) and backends.md §1.3.
"""

from __future__ import annotations

import re

from collections.abc import Iterable, Mapping, Sequence

import torch

from qpass.errors import QuantizationError

NVFP4_ACT_MAXBOUND = 6.0 * 448.0  # E2M1 max x E4M3 max = 2688


def input_amax(model: torch.nn.Module, sites: Iterable[str], batches: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """max |x| (float32, 0-d) of each site's linear input over the calibration token sequences.

    Args:
        model: an HF causal LM (eval); ``sites`` are its ``nn.Linear`` module paths
            (``model.layers.0.mlp.gate_proj``).
        batches: token-id sequences, run one at a time (no padding, so every token counts).
    Raises:
        QuantizationError: a site is no ``nn.Linear`` of ``model``; no calibration sequence; a NaN/inf input.
    """
    sites = list(sites)
    if not batches:
        raise QuantizationError("input_scale calibration needs at least one prompt")
    modules = dict(model.named_modules())
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for s in sites:
        m = modules.get(s)
        if not isinstance(m, torch.nn.Linear):
            raise QuantizationError(f"calibration site {s} is not an nn.Linear of {type(model).__name__}")

        def hook(_mod, args, _site=s):  # noqa: ANN001
            if args[0].numel() == 0:  # an MoE expert no token of this prompt was routed to
                return
            a = args[0].detach().abs().amax().float().cpu()
            amax[_site] = torch.maximum(amax[_site], a) if _site in amax else a
        hooks.append(m.register_forward_pre_hook(hook))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device))
    finally:
        for h in hooks:
            h.remove()
    for s, a in amax.items():
        if not bool(torch.isfinite(a)):
            raise QuantizationError(f"calibration: site {s} saw a non-finite activation (amax {a.item()})")
    return amax


_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.\d+\.(?P<role>[^.]+)$")


def group_input_amax(amax: Mapping[str, torch.Tensor], groups: Mapping[str, str],
                     unreached: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Per site the max of its fused group's input amax (float32 0-d; members share one GEMM input).

    An MoE expert site (``<layer>.experts.<e>.<role>``) that no calibration token was routed to
    takes the max amax of the same ``<role>`` over that layer's experts that were reached (for the
    W13 roles this is the amax of the layer's expert input over the calibration tokens routed
    anywhere; for ``down`` a stand-in); such sites are appended to ``unreached``.

    Args:
        amax: per site max |x| (from :func:`input_amax`).
        groups: site -> fused-group id.
        unreached: if given, collects the expert sites that took the fallback.
    Raises:
        QuantizationError: a site without calibration data (and no reached sibling expert), or a
            group whose amax is 0 (its input was all zeros on every calibration token: no scale can be derived).
    """
    amax = dict(amax)
    sibling: dict[tuple[str, str], torch.Tensor] = {}
    for s, a in amax.items():
        m = _EXPERT.match(s)
        if m:
            k = (m["layer"], m["role"])
            sibling[k] = torch.maximum(sibling[k], a) if k in sibling else a
    for s in groups:
        m = _EXPERT.match(s)
        if s not in amax and m and (m["layer"], m["role"]) in sibling:
            amax[s] = sibling[(m["layer"], m["role"])]
            if unreached is not None:
                unreached.append(s)
    gmax: dict[str, torch.Tensor] = {}
    for s, g in groups.items():
        if s not in amax:
            raise QuantizationError(f"calibration: no activation recorded for site {s}")
        gmax[g] = torch.maximum(gmax[g], amax[s]) if g in gmax else amax[s]
    out = {}
    for s, g in groups.items():
        a = gmax[g].float().reshape(())
        if not bool(a > 0):
            raise QuantizationError(f"calibration: fused group {g} (site {s}) had an all-zero input on every calibration token")
        out[s] = a
    return out


def input_scale(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's static activation decode scale ``fl(amax / 2688)`` (float32, a multiplier)."""
    a = amax.float()
    return a / torch.full_like(a, NVFP4_ACT_MAXBOUND)


def input_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' static activation global scale ``fl(2688 / amax)`` (float32, a divisor)."""
    a = amax.float()
    return torch.full_like(a, NVFP4_ACT_MAXBOUND) / a
