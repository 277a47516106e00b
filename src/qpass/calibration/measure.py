"""Site inputs of an unquantized model on calibration tokens, and the model weights' fingerprint.

Calibration activations are the inputs of each linear site in the model's own forward (forward
pre-hooks on the ``nn.Linear`` modules, whose paths are qpass's site ids), one calibration sequence
per forward (no padding: every token counts). This is the convention of ModelOpt's post-training
calibration (statistics of the unquantized model) and needs no graph capture, so the same function
serves ``qpass calibrate``, ``qpass export`` and the GRPO re-calibration after a weight sync.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from qpass.calibration.source import CalibrationError
from qpass.progress import track

_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.\d+\.(?P<role>[^.]+)$")


def site_inputs(model: torch.nn.Module, sites: Iterable[str], batches: Sequence[Sequence[int]], *,
                keep: Iterable[str] = ()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run every calibration sequence through ``model``; per site its input amax (and, for ``keep``, the rows).

    Args:
        model: an HF causal LM (its ``nn.Linear`` module paths are the site ids); run in eval mode
            under ``torch.no_grad`` on its own device.
        sites: the sites whose input amax to record.
        batches: token-id sequences, one forward each.
        keep: sites whose input rows to return concatenated (``[M, K]`` in the model dtype, on CPU).
    Returns:
        ``(amax, rows)``: ``{site: float32 0-d max|x|}`` over every token (sites no token reached,
        e.g. an MoE expert, are absent) and ``{site: [M, K]}`` for ``keep``.
    Raises:
        CalibrationError: no sequence; an empty sequence; a site that is no ``nn.Linear`` of
            ``model``; a non-finite input (names the site).
    """
    sites, keep = list(dict.fromkeys(sites)), set(keep)
    if not batches:
        raise CalibrationError("calibration needs at least one prompt")
    if any(len(b) == 0 for b in batches):
        raise CalibrationError("calibration: a prompt encodes to no token")
    modules = dict(model.named_modules())
    amax: dict[str, torch.Tensor] = {}
    rows: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for s in dict.fromkeys([*sites, *keep]):
        m = modules.get(s)
        if not isinstance(m, torch.nn.Linear):
            raise CalibrationError(f"calibration site {s} is not an nn.Linear of {type(model).__name__}")

        def hook(_mod, args, _site=s):  # noqa: ANN001
            x = args[0]
            if x.numel() == 0:  # an MoE expert no token of this prompt was routed to
                return
            x = x.detach()
            a = x.abs().amax().float().cpu()
            amax[_site] = torch.maximum(amax[_site], a) if _site in amax else a
            if _site in keep:
                rows.setdefault(_site, []).append(x.reshape(-1, x.shape[-1]).cpu().clone())
        hooks.append(m.register_forward_pre_hook(hook))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in track(batches, "calibration forwards of the unquantized model", unit="prompt"):
                model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device))
    finally:
        for h in hooks:
            h.remove()
    for s, a in amax.items():
        if not bool(torch.isfinite(a)):
            raise CalibrationError(f"calibration: site {s} saw a non-finite activation (amax {a.item()})")
    return {s: a for s, a in amax.items() if s in set(sites)}, {s: torch.cat(r) for s, r in rows.items()}


def fill_unreached_experts(amax: Mapping[str, torch.Tensor], sites: Iterable[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``amax`` plus, for each MoE expert site (``<layer>.experts.<e>.<role>``) no calibration token
    reached, the max amax of the same ``<role>`` over that layer's reached experts (for the W13 roles
    the amax of the layer's expert input over the tokens routed anywhere; for ``down`` a stand-in).

    Returns:
        ``(amax with the stand-ins, the expert sites that took one)``.
    """
    out = dict(amax)
    sibling: dict[tuple[str, str], torch.Tensor] = {}
    for s, a in amax.items():
        m = _EXPERT.match(s)
        if m:
            k = (m["layer"], m["role"])
            sibling[k] = torch.maximum(sibling[k], a) if k in sibling else a
    filled = []
    for s in sites:
        m = _EXPERT.match(s)
        if s not in out and m and (m["layer"], m["role"]) in sibling:
            out[s] = sibling[(m["layer"], m["role"])]
            filled.append(s)
    return out, filled


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (hex) of every tensor of ``model.state_dict()`` (names sorted; name, dtype, shape, raw bytes).

    Identifies the weights a calibration was computed on (0.5 s for the default 135M model).
    """
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
