"""Layer-wise activation mismatch and the per-channel activation-quantization residual (SPEC §4).

* :func:`layerwise_mismatch`: per site, ``||X_roll - X_learn||_F`` (and relative to
  ``||X_learn||_F``) for the inputs of the same linear in the rollout and learner forwards
  (QUADS: ``eta + Delta X_q`` at each projection; SPEC §2).
* :func:`residual_channel_map`: per input channel ``j``, the mean and max over tokens of
  ``|X - DQ(Q_A(X))|`` with the rollout's NVFP4 activation quantizer ``Q_A`` (SPEC §3 rule 5),
  plus ``||R[:, j]||_2``, the un-quantized form of the RAC channel score ``s_j`` (SPEC §2).

Only valid tokens count: with a ``mask`` (True on valid tokens), padded rows are dropped
*before* anything is computed, including the dynamic activation global scale, so garbage in
padding cannot move a number. The residual map therefore quantizes the valid rows as one packed
forward batch, which is what a packed rollout engine sees.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from qpass.diagnostics.robust import norm_ratio, pow2_exponent, scaled, unscale
from qpass.formats.spec import NVFP4_ACT, NVFP4Spec
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize

__all__ = ["ChannelResidualMap", "SiteMismatch", "layerwise_mismatch", "residual_channel_map"]


def _valid_rows(x: torch.Tensor, mask: torch.Tensor | None, what: str) -> torch.Tensor:
    """``x[..., C]`` -> ``[n_valid, C]`` (rows where ``mask`` is True; all rows if None)."""
    if x.dim() < 2:
        raise ValueError(f"{what} must have at least 2 dims [..., channels], got shape {tuple(x.shape)}")
    if mask is None:
        return x.reshape(-1, x.shape[-1])
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask for {what} must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the leading dims {tuple(x.shape[:-1])} of {what}")
    m = mask if mask.dtype == torch.bool else mask != 0
    return x[m.to(x.device)]


@dataclasses.dataclass(frozen=True)
class SiteMismatch:
    """Activation mismatch at one site (valid tokens only).

    Attributes:
        site: site name.
        fro: ``||X_roll - X_learn||_F`` (float64 arithmetic; activation units; ``inf`` only if it
            exceeds ``DBL_MAX``).
        rel: ``fro / ||X_learn||_F``; 0 if both are 0, ``inf`` if only ``X_learn`` is 0; finite for
            huge finite activations (both norms on one power-of-two rescaled copy).
        max_abs: ``max |X_roll - X_learn|``.
        rms: ``fro / sqrt(numel)``.
        n_tokens: valid rows compared; numel: elements compared.
    """

    site: str
    fro: float
    rel: float
    max_abs: float
    rms: float
    n_tokens: int
    numel: int


def layerwise_mismatch(
    acts_learner: Mapping[str, torch.Tensor],
    acts_rollout: Mapping[str, torch.Tensor],
    mask: torch.Tensor | None = None,
    *,
    strict: bool = True,
) -> dict[str, SiteMismatch]:
    """Per-site ``||X_roll - X_learn||`` on valid tokens (SPEC §4, layer-wise activation mismatch).

    Args:
        acts_learner: ``{site: X_learn}``, each float ``[..., C]`` (e.g. ``[B, T, K]`` linear inputs).
        acts_rollout: ``{site: X_roll}`` with the same shapes per site.
        mask: optional bool/0-1 token mask equal to the leading dims of every activation
            (``[B, T]`` for ``[B, T, K]``); None = every row is valid.
        strict: if True (default) the two key sets must be equal; if False only common sites are
            compared.
    Returns:
        ``{site: SiteMismatch}`` in the order of ``acts_learner``.
    Raises:
        ValueError: key sets differ (strict; both differences listed), shapes differ at a site, or
            a NaN/inf activation (the site and side are named: a non-finite activation is a bug
            upstream, not a mismatch).
        TypeError: a bad mask.
    Source: SPEC §4; QUADS compares layer-wise mismatch of asymmetric vs symmetric QAT this way.
    """
    ka, kb = set(acts_learner), set(acts_rollout)
    if strict and ka != kb:
        raise ValueError(
            f"layerwise_mismatch: sites differ; only in learner: {sorted(ka - kb)}, only in rollout: {sorted(kb - ka)}"
        )
    out: dict[str, SiteMismatch] = {}
    with torch.no_grad():
        for site in acts_learner:
            if site not in kb:
                continue
            xl, xr = acts_learner[site], acts_rollout[site]
            if tuple(xl.shape) != tuple(xr.shape):
                raise ValueError(
                    f"layerwise_mismatch: site {site!r}: learner shape {tuple(xl.shape)} != rollout shape {tuple(xr.shape)}"
                )
            rl = _valid_rows(xl.detach(), mask, f"acts_learner[{site!r}]").double()
            rr = _valid_rows(xr.detach(), mask, f"acts_rollout[{site!r}]").to(rl.device).double()
            for side, t in (("learner", rl), ("rollout", rr)):
                bad = ~torch.isfinite(t)
                if bool(bad.any()):
                    raise ValueError(f"layerwise_mismatch: {int(bad.sum())} non-finite {side} activation(s) at site {site!r}")
            # one power-of-two scale for both sides when the squares (or the difference) could overflow
            # float64 (qpass.diagnostics.robust): rel and rms stay finite for huge finite activations
            numel = rl.numel()
            e = pow2_exponent(max(float(rl.abs().max()) if numel else 0.0, float(rr.abs().max()) if numel else 0.0), 2 * numel, power=2)
            diff = scaled(rr, e) - scaled(rl, e)
            fro_s = float(torch.linalg.vector_norm(diff))
            rel = norm_ratio(diff, scaled(rl, e))
            out[site] = SiteMismatch(
                site=site,
                fro=unscale(fro_s, e),
                rel=rel,
                max_abs=unscale(float(diff.abs().max()), e) if numel else 0.0,
                rms=unscale(fro_s / math.sqrt(numel), e) if numel else 0.0,
                n_tokens=rl.shape[0],
                numel=numel,
            )
    return out


@dataclasses.dataclass(frozen=True)
class ChannelResidualMap:
    """Per-channel NVFP4 activation-quantization residual ``|Delta X_q| = |X - DQ(Q_A(X))|``.

    Attributes:
        mean_abs: float32 ``[K]``: mean over valid tokens of ``|R[:, j]|``.
        max_abs: float32 ``[K]``: max over valid tokens.
        l2: float32 ``[K]``: ``||R[:, j]||_2`` (the RAC score ``s_j``, SPEC §2, in float).
        n_tokens: valid tokens (rows) used; 0 gives NaN maps.
        spec_key: the activation spec used (e.g. ``nvfp4.activation.per_tensor``).
    """

    mean_abs: torch.Tensor
    max_abs: torch.Tensor
    l2: torch.Tensor
    n_tokens: int
    spec_key: str


def residual_channel_map(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    spec: NVFP4Spec = NVFP4_ACT,
    site: str | None = None,
) -> ChannelResidualMap:
    """Per-channel ``|X - DQ(Q_A(X))|`` over valid tokens (SPEC §4 residual map, SPEC §2 ``R``).

    ``R = fl(float(X) - float(bf16 DQ(Q_A(X))))`` exactly as :func:`qpass.quant.rac.rac_reference`
    computes it, with ``Q_A`` the NVFP4 activation quantizer (dynamic global scale from the valid
    rows; per row with ``NVFP4_ACT_PER_TOKEN``).

    Args:
        x: bf16/fp16/fp32 ``[..., K]`` linear input, ``K % 16 == 0``, finite on valid rows.
        mask: optional bool/0-1 mask equal to ``x.shape[:-1]``; rows where False are dropped
            before quantization. None = all rows.
        spec: activation :class:`NVFP4Spec` (default ``NVFP4_ACT``: per-tensor dynamic scale).
        site: names the site in errors.
    Returns:
        :class:`ChannelResidualMap` (tensors on ``x``'s device).
    Raises:
        QuantizationError: ``K % 16 != 0``, NaN/inf in a valid row (site named), bad dtype.
        ValueError, TypeError: bad mask.
    """
    rows = _valid_rows(x.detach(), mask, f"activation at site {site}" if site else "x")
    k = x.shape[-1]
    if rows.shape[0] == 0:
        nan = torch.full((k,), math.nan, dtype=torch.float32, device=x.device)
        return ChannelResidualMap(nan, nan.clone(), nan.clone(), 0, spec.key)
    with torch.no_grad():
        q = nvfp4_quantize(rows, spec=spec, name="activation", site=site)
        x_hat = nvfp4_dequantize(q, torch.bfloat16)
        r = rows.float() - x_hat.float()
        a = r.abs()
        return ChannelResidualMap(
            mean_abs=a.double().mean(0).float(),
            max_abs=a.amax(0),
            l2=torch.sqrt((r.double() ** 2).sum(0)).float(),
            n_tokens=int(rows.shape[0]),
            spec_key=spec.key,
        )
