"""What a calibrating pass asks for, and the source that answers (the ``PassContext.calibration`` seam).

Two passes read calibration data while they rewrite the rollout graph:

* ``w4a4_lower`` with ``act_scale: static`` asks :meth:`CalibrationSource.input_amax` for the
  calibrated input amax of its sites (one per fused group: q/k/v and gate/up share one, SPEC §3
  rule 1) and stores it as each site's ``act_amax`` constant;
* ``residual_compensation`` with ``selection: static`` asks :meth:`CalibrationSource.rac_channels`
  for each site's channels and stores them as its ``rac_channels`` constant.

Sources: :class:`ActivationSource` computes the answers from given calibration activations with the
one channel function :func:`qpass.quant.rac.static_channels` (what ``qpass calibrate`` runs, and what
tests feed synthetic activations to); :class:`qpass.calibration.record.Calibration` (a verified
calibration file) looks them up and refuses a request it was not computed for, naming the file,
the site and what differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from qpass.errors import QpassError
from qpass.formats.spec import NVFP4_OP_ACT_MODES, nvfp4_act_spec_of
from qpass.quant.rac import rac_num_channels, static_channel_scores, topk_channels

#: The quantized NVFP4 activation modes of the op (``nvfp4``, ``nvfp4_per_token``, ``nvfp4_static``).
ACTS = tuple(m for m, spec in NVFP4_OP_ACT_MODES.items() if spec is not None)


class CalibrationError(QpassError):
    """A calibration that is missing, corrupt, or does not fit the model / recipe it is used with (exit 2)."""


@dataclasses.dataclass(frozen=True)
class RACRequest:
    """A static-RAC site asks for its channels.

    Attributes:
        site: site id (``model.layers.0.mlp.gate_proj``).
        ratio: the pass's ``ratio``; ``k = floor(ratio * in_features)`` channels.
        act: the site's activation mode (``nvfp4`` | ``nvfp4_per_token`` | ``nvfp4_static``): which
            ``Q_A`` the residual is scored under.
        in_features: K.
        act_amax: the site's calibrated amax when ``act == 'nvfp4_static'`` (float32 0-d), else None.
    """

    site: str
    ratio: float
    act: str
    in_features: int
    act_amax: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return rac_num_channels(self.in_features, self.ratio)


@dataclasses.dataclass(frozen=True)
class AmaxRequest:
    """A static-activation-scale site asks for its input amax.

    Attributes:
        site: site id.
        group: fused-group id in the graph being rewritten (members share one amax).
        in_features: K.
    """

    site: str
    group: str
    in_features: int


class CalibrationSource(Protocol):
    """Answers the calibrating passes (module docstring). ``name`` is what messages call it."""

    name: str

    def input_amax(self, requests: Sequence[AmaxRequest]) -> dict[str, torch.Tensor]:
        """Per requested site the float32 0-d amax shared by its group (max over the requested members)."""

    def rac_channels(self, requests: Sequence[RACRequest]) -> dict[str, torch.Tensor]:
        """Per requested site the int64 ``[k]`` channels, sorted ascending."""


def group_max(per_site: Mapping[str, torch.Tensor], requests: Sequence[AmaxRequest]) -> dict[str, torch.Tensor]:
    """``{site: max of per_site over the requested members of its group}`` (float32 0-d, bit-identical per group)."""
    gmax: dict[str, torch.Tensor] = {}
    for r in requests:
        a = per_site[r.site].detach().float().reshape(()).cpu()
        gmax[r.group] = a if r.group not in gmax else torch.maximum(gmax[r.group], a)
    return {r.site: gmax[r.group].clone() for r in requests}


def residual_scores(x: torch.Tensor, act: str, act_amax: torch.Tensor | None = None, site: str | None = None) -> torch.Tensor:
    """int64 ``[K]`` channel scores of calibration activations ``x`` [..., K] under activation mode ``act``
    (:func:`qpass.quant.rac.static_channel_scores`; their top-k is :func:`qpass.quant.rac.static_channels`).

    Raises:
        CalibrationError: an unknown activation mode.
    """
    if act not in ACTS:
        raise CalibrationError(f"calibration: site {site}: activation mode {act!r} is not one of {ACTS}")
    spec = nvfp4_act_spec_of(act, f"site {site}")
    return static_channel_scores(x.reshape(-1, x.shape[-1]), act_spec=spec, act_amax=act_amax, site=site)


@dataclasses.dataclass
class ActivationSource:
    """Answers from calibration activations (``qpass calibrate``; tests).

    Attributes:
        activations: ``{site: [M, K] every calibration token}``, or a callable ``(sites) -> that``
            that collects them on demand (one model sweep per pass request).
        amax: ``{site: float32 0-d max|x|}``; default: from ``activations``.
        name: for messages.
        served_rac: filled in: per site the request answered, its channels and int64 scores.
        served_amax: filled in: per site the group amax answered.
    """

    activations: Mapping[str, torch.Tensor] | Callable[[list[str]], Mapping[str, torch.Tensor]]
    amax: Mapping[str, torch.Tensor] | None = None
    name: str = "calibration activations"
    served_rac: dict[str, tuple[RACRequest, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    served_amax: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def _acts(self, sites: list[str]) -> Mapping[str, torch.Tensor]:
        acts = self.activations(sites) if callable(self.activations) else self.activations
        missing = [s for s in sites if s not in acts or acts[s].numel() == 0]
        if missing:
            raise CalibrationError(f"{self.name}: no calibration activation for site(s) {missing[:4]} "
                                   "(an MoE expert no calibration token reached? give more prompts)")
        return acts

    def input_amax(self, requests: Sequence[AmaxRequest]) -> dict[str, torch.Tensor]:
        if self.amax is not None:
            missing = [r.site for r in requests if r.site not in self.amax]
            if missing:
                raise CalibrationError(f"{self.name}: no calibrated input amax for site(s) {missing[:4]}")
            per_site = {r.site: self.amax[r.site] for r in requests}
        else:
            acts = self._acts([r.site for r in requests])
            per_site = {r.site: acts[r.site].detach().abs().amax().float() for r in requests}
        out = group_max(per_site, requests)
        self.served_amax.update(out)
        return out

    def rac_channels(self, requests: Sequence[RACRequest]) -> dict[str, torch.Tensor]:
        acts = self._acts([r.site for r in requests])
        out = {}
        for r in requests:
            x = acts[r.site]
            if x.shape[-1] != r.in_features:
                raise CalibrationError(f"{self.name}: site {r.site} activations have K={x.shape[-1]}, the site has {r.in_features}")
            scores = residual_scores(x, r.act, r.act_amax, r.site)
            ch = topk_channels(scores, r.k)
            out[r.site] = ch
            self.served_rac[r.site] = (r, ch, scores)
        return out
