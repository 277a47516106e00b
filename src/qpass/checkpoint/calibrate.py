"""Static activation scales for W4A4 checkpoints: ``input_scale`` calibrated on prompts.

qpass's own plugins quantize activations dynamically (SPEC §3 rule 5) and ignore ``input_scale``; a
W4A4 consumer with static activation scales (vLLM's and SGLang's ``modelopt_fp4``) reads one per
linear and needs it shared within a fused group (one GEMM input). The scales follow the SPEC §3
arithmetic of the group amax (the max |x| of the linear's input over the calibration tokens, max
over q/k/v resp. gate/up): ``input_scale = S_dec = fl(1/fl(2688/amax))`` (a decode **multiplier**,
as ``weight_scale_2``, so the engine's ``alpha = input_scale * weight_scale_2`` is SPEC §3.1's
``fl(S_dec_X * S_dec_W)`` bit for bit) and ``input_global_scale = S_enc = fl(2688/amax)`` (an encode
divisor, compressed-tensors naming). ModelOpt itself writes ``fl(amax/2688)``, which differs from
``S_dec`` by one ulp for some amax (prior-art/nvfp4_semantics.md G1); vLLM's ``modelopt_fp4``
encodes with ``fl(1/input_scale)``, which need not be ``S_enc`` either.

Source: SPEC §3 (global scales, rule 1 groups, rule 6 conventions); prior-art/nvfp4_semantics.md
("ModelOpt export" row; "ModelOpt format: weight_scale_2 / input_scale := S_dec") and backends.md §1.3.
Measurement: :mod:`qpass.calibration.measure`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from qpass.errors import QuantizationError

NVFP4_ACT_MAXBOUND = 6.0 * 448.0  # E2M1 max x E4M3 max = 2688


def input_amax(model: torch.nn.Module, sites: Iterable[str], batches: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """max |x| (float32, 0-d) of each site's linear input over the calibration token sequences
    (:func:`qpass.calibration.measure.site_inputs`; sites no token reached are absent).

    Raises:
        QuantizationError: a site is no ``nn.Linear`` of ``model``; no calibration sequence; a NaN/inf input.
    """
    from qpass.calibration.measure import site_inputs
    from qpass.calibration.source import CalibrationError

    try:
        return site_inputs(model, sites, batches)[0]
    except CalibrationError as exc:
        raise QuantizationError(str(exc)) from exc


def group_input_amax(amax: Mapping[str, torch.Tensor], groups: Mapping[str, str],
                     unreached: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Per site the max of its fused group's input amax (float32 0-d; members share one GEMM input).

    An MoE expert site no calibration token was routed to takes a sibling expert's amax
    (:func:`qpass.calibration.measure.fill_unreached_experts`); such sites are appended to ``unreached``.

    Args:
        amax: per site max |x| (from :func:`input_amax`).
        groups: site -> fused-group id.
        unreached: if given, collects the expert sites that took the fallback.
    Raises:
        QuantizationError: a site without calibration data (and no reached sibling expert), or a
            group whose amax is 0 (its input was all zeros on every calibration token: no scale can be derived).
    """
    from qpass.calibration.measure import fill_unreached_experts

    amax, filled = fill_unreached_experts(amax, groups)
    if unreached is not None:
        unreached.extend(filled)
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
    """The static activation decode scale ``S_dec = fl(1/fl(2688/amax))`` (float32, a multiplier; SPEC §3,
    :func:`qpass.quant.nvfp4.global_scales`): ModelOpt's ``input_scale`` slot."""
    from qpass.quant.nvfp4 import global_scales

    return global_scales(amax.float())[1]


def input_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The static activation encode scale ``S_enc = fl(2688/amax)`` (float32, a divisor; SPEC §3):
    compressed-tensors' ``input_global_scale``."""
    from qpass.quant.nvfp4 import global_scales

    return global_scales(amax.float())[0]
