"""The typed calls of qpass's rollout ops: what every kernel of an op receives, named and typed.

A graph node of ``qpass::nvfp4_linear`` carries flat arguments (``torch.export`` needs them:
tensors, strings, floats). At the op boundary they become ONE frozen object, built once per call by
its ``from_args`` classmethod (specs instead of mode strings, ``RACConfig`` instead of three scalars,
``k`` derived once), and the kernel of every backend (``reference``, ``triton``, and backends to come)
is written against its fields. ``to_args()`` gives the flat arguments back; ``encode``/``decode``
(NVFP4) are the one mapping between an op's option arguments and their typed form, used by the
lowering passes, the exports and the diagnostics that read graph nodes.

Field names of :class:`NVFP4LinearCall`, :class:`FP8LinearCall` and :class:`MXFP4LinearCall` are a
stable contract (docs/DESIGN.md, "Op contract"): add fields, never rename them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from qpass.errors import QpassError, QuantizationError
from qpass.formats.spec import (
    FP8Spec,
    Granularity,
    MXFP4_WEIGHT,
    NVFP4_WEIGHT,
    NVFP4Spec,
    QuantSpec,
    nvfp4_act_mode,
    nvfp4_act_spec_of,
)
from qpass.quant.fp8 import FP8Tensor
from qpass.quant.mxfp4 import MXFP4Tensor
from qpass.quant.nvfp4 import NVFP4Tensor
from qpass.quant.rac import RACConfig

# the flat encoding of "no residual compensation" (the lowering's defaults)
_NO_RAC = {"rac_ratio": 0.0, "rac_mode": "masked", "rac_selection": "batch"}


def _check_k(x: torch.Tensor, k: int, site: str) -> None:
    if x.shape[-1] != k:
        raise QuantizationError(f"input has K={x.shape[-1]} but the weight has K={k} at site {site}")


class _WeightKChecked:
    """Base of a call dataclass with fields ``x [..., K]``, ``weight`` (shape ``[N, K]``) and ``site``.

    Raises:
        QuantizationError: at construction, ``x``'s last dim is not the weight's K (names the site).
    """

    def __post_init__(self) -> None:
        _check_k(self.x, int(self.weight.shape[-1]), self.site)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True, eq=False)
class NVFP4LinearCall:
    """One call of ``qpass::nvfp4_linear``: ``y [..., N] = x [..., K] @ W^T (+ bias)`` with NVFP4 weights.

    Fields (stable names; every kernel reads these):
        x: activation ``[..., K]``, bf16/fp16/fp32; all leading dims are one forward batch (the
            dynamic activation global scale and RAC ``batch`` selection see all of its rows).
        weight: the quantized weight ``[N, K]`` (:class:`~qpass.quant.nvfp4.NVFP4Tensor`):
            ``codes`` uint8 ``[N, K/2]`` (element 2j in the low nibble), ``scales`` float8_e4m3fn
            ``[N, K/16]`` (linear layout), ``s_dec`` float32 0-dim decode multiplier ``S_dec_W``.
        bias: ``[N]`` or None.
        act: the activation spec: ``NVFP4_ACT`` (W4A4, dynamic per-tensor global scale),
            ``NVFP4_ACT_PER_TOKEN`` (one global scale per row), ``NVFP4_ACT_STATIC`` (W4A4 with the
            calibrated per-tensor amax ``act_amax``, ``qpass calibrate``) or None (W4A16: ``x`` as given).
        rac: residual activation compensation (SPEC §2) or None. None also when ``act`` is None or
            the ratio selects no channel (``rac_k == 0``: plain W4A4, the reference rule).
        rac_channels: int64 ``[rac_k]`` calibrated channels for ``rac.selection == 'static'``, else None.
        site: the site id (every error names it).
        out_dtype: output dtype (``x.dtype`` for the op).
        act_amax: float32 0-d calibrated input amax of the site's fused group for a static ``act``
            (SPEC §3 with rule 5's global scale from calibration:
            :func:`qpass.quant.nvfp4.nvfp4_quantize_static`), else None. Only kernels that declare
            :func:`qpass.ops.linear.serves_static_act` receive a call with one; the others are refused
            by name before they run (:func:`qpass.ops.linear.static_act_kernel_check`).
    Derived once, at construction:
        rac_k: the number of compensated channels, ``rac.num_channels(K)`` (0 without RAC).
    Raises (construction):
        QuantizationError: ``x``'s K differs from the weight's; a static ``act`` without ``act_amax``
            or an ``act_amax`` with another ``act`` (names the site).
    """

    x: torch.Tensor
    weight: NVFP4Tensor
    bias: torch.Tensor | None
    act: NVFP4Spec | None
    rac: RACConfig | None
    rac_channels: torch.Tensor | None
    site: str
    out_dtype: torch.dtype
    act_amax: torch.Tensor | None = None
    rac_k: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        _check_k(self.x, self.in_features, self.site)
        if self.static_act and self.act_amax is None:
            raise QuantizationError(f"nvfp4_linear at site {self.site}: static activation scale ('nvfp4_static') but no "
                                    "calibrated amax (act_amax is None)")
        if not self.static_act and self.act_amax is not None:
            raise QuantizationError(f"nvfp4_linear at site {self.site}: a calibrated act_amax was given for activation mode "
                                    f"{nvfp4_act_mode(self.act)!r} (it goes with 'nvfp4_static' only)")
        rac = self.rac if self.act is not None else None
        k = rac.num_channels(self.in_features) if rac is not None else 0
        object.__setattr__(self, "rac", rac if k > 0 else None)
        object.__setattr__(self, "rac_k", k if k > 0 else 0)
        if self.rac is None or self.rac.selection != "static":
            object.__setattr__(self, "rac_channels", None)

    @property
    def in_features(self) -> int:
        """K."""
        return int(self.weight.shape[-1])

    @property
    def out_features(self) -> int:
        """N."""
        return int(self.weight.codes.shape[0])

    @property
    def weight_spec(self) -> QuantSpec:
        """The weight spec (the ``kernels`` table is keyed by its type)."""
        return NVFP4_WEIGHT

    @property
    def w4a16(self) -> bool:
        """Activations are not quantized (``act`` is None)."""
        return self.act is None

    @property
    def per_token(self) -> bool:
        """W4A4 with one activation global scale per row."""
        return self.act is not None and self.act.global_scope == "per_token"

    @property
    def static_act(self) -> bool:
        """W4A4 with a static (calibrated) per-tensor activation global scale (``act_amax``)."""
        return self.act is not None and self.act.global_source == "static"

    # ------------------------------------------------------------------ flat <-> typed
    @staticmethod
    def encode(act: NVFP4Spec | None, rac: RACConfig | None = None) -> dict[str, Any]:
        """The op's option arguments (``act``, ``rac_ratio``, ``rac_mode``, ``rac_selection``) of a
        typed activation spec and RAC config (``rac_channels`` and ``act_amax`` are tensor arguments:
        set them apart)."""
        out = {"act": nvfp4_act_mode(act)}
        out.update(_NO_RAC if rac is None else {"rac_ratio": float(rac.ratio), "rac_mode": rac.mode,
                                                 "rac_selection": rac.selection})
        return out

    @staticmethod
    def decode(args: Mapping[str, Any], site: str = "") -> tuple[NVFP4Spec | None, RACConfig | None]:
        """``(activation spec, RACConfig or None)`` of the op's option arguments (a node's
        :func:`qpass.graph.opargs.op_args` or the flat arguments of a call). A ratio of 0 is None.

        Raises:
            QpassError: unknown activation mode or RAC option (names the site).
        """
        where = f"nvfp4_linear at site {site or args.get('site', '')}"
        try:
            act = nvfp4_act_spec_of(args["act"], where)
            ratio = float(args["rac_ratio"])
            rac = RACConfig(ratio, args["rac_mode"], args["rac_selection"]) if ratio > 0 else None
        except ValueError as exc:
            raise QpassError(f"{where}: {exc}" if where not in str(exc) else str(exc)) from None
        return act, rac

    @classmethod
    def from_args(cls, *, x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, w_s_dec: torch.Tensor,
                  bias: torch.Tensor | None, site: str, act: str, rac_ratio: float, rac_mode: str, rac_selection: str,
                  rac_channels: torch.Tensor | None, act_amax: torch.Tensor | None = None) -> "NVFP4LinearCall":
        """The call of the op's flat arguments (the op's schema order)."""
        act_spec, rac = cls.decode({"act": act, "rac_ratio": rac_ratio, "rac_mode": rac_mode,
                                    "rac_selection": rac_selection}, site)
        return cls(x=x, weight=NVFP4Tensor.from_parts(w_codes, w_scales, w_s_dec), bias=bias, act=act_spec, rac=rac,
                   rac_channels=rac_channels, site=site, out_dtype=x.dtype, act_amax=act_amax)

    def to_args(self) -> dict[str, Any]:
        """The op's flat arguments of this call."""
        w = self.weight
        return {"x": self.x, "w_codes": w.codes, "w_scales": w.scales, "w_s_dec": w.s_dec, "bias": self.bias,
                "site": self.site, **self.encode(self.act, self.rac), "rac_channels": self.rac_channels,
                "act_amax": self.act_amax}

    @classmethod
    def lowering_args(cls, weight: QuantSpec, act: QuantSpec | None, site: str) -> dict[str, Any]:
        """The option arguments of a freshly lowered site (RAC off; ``rac_channels`` None; ``act_amax``
        None: the lowering pass sets the calibrated constant of a static ``act``).

        Raises:
            QpassError: ``act`` is not an NVFP4 activation spec (names the site).
        """
        try:
            return {**cls.encode(act, None), "rac_channels": None, "act_amax": None}
        except ValueError as exc:
            raise QpassError(f"site {site}: qpass::nvfp4_linear cannot quantize activations as {act.key}: {exc}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class FP8LinearCall(_WeightKChecked):
    """One call of ``qpass::fp8_linear``: W8A8 FP8 E4M3 ``y [..., N] = x [..., K] @ W^T (+ bias)``.

    Fields (stable):
        x: activation ``[..., K]`` bf16/fp16/fp32.
        weight: :class:`~qpass.quant.fp8.FP8Tensor` ``[N, K]`` (``data`` float8_e4m3fn, ``scale``
            float32 decode multipliers of ``weight.spec``'s granularity).
        bias: ``[N]`` or None.
        act: the activation spec (granularity of the dynamic activation scales).
        site: the site id.
        out_dtype: output dtype (``x.dtype`` for the op).
    """

    x: torch.Tensor
    weight: FP8Tensor
    bias: torch.Tensor | None
    act: FP8Spec
    site: str
    out_dtype: torch.dtype

    @property
    def weight_spec(self) -> QuantSpec:
        return self.weight.spec

    @classmethod
    def from_args(cls, *, x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                  site: str, act_granularity: str, w_granularity: str) -> "FP8LinearCall":
        wspec = FP8Spec(role="weight", granularity=Granularity(w_granularity))
        w = FP8Tensor(data=w_data, scale=w_scale, shape=w_data.shape, orig_dtype=torch.bfloat16, spec=wspec)
        return cls(x=x, weight=w, bias=bias, act=FP8Spec(role="activation", granularity=Granularity(act_granularity)),
                   site=site, out_dtype=x.dtype)

    def to_args(self) -> dict[str, Any]:
        return {"x": self.x, "w_data": self.weight.data, "w_scale": self.weight.scale, "bias": self.bias,
                "site": self.site, "act_granularity": self.act.granularity.value,
                "w_granularity": self.weight.spec.granularity.value}

    @classmethod
    def lowering_args(cls, weight: QuantSpec, act: QuantSpec | None, site: str) -> dict[str, Any]:
        """``act_granularity`` / ``w_granularity`` of a lowered site.

        Raises:
            QpassError: no FP8 activation spec (W8A8 needs one; names the site).
        """
        if not isinstance(act, FP8Spec):
            raise QpassError(f"site {site}: qpass::fp8_linear needs an FP8 activation spec, got "
                             f"{act.key if act is not None else None}")
        return {"act_granularity": act.granularity.value, "w_granularity": weight.granularity.value}


@dataclasses.dataclass(frozen=True, eq=False)
class MXFP4LinearCall(_WeightKChecked):
    """One call of ``qpass::mxfp4_linear``: MXFP4 weight-only ``y = x @ W^T (+ bias)``.

    Fields (stable):
        x: activation ``[..., K]``; weight: :class:`~qpass.quant.mxfp4.MXFP4Tensor` ``[N, K]``
        (codes uint8 ``[N, K/2]``, E8M0 scale bytes ``[N, K/32]``); bias ``[N]`` or None; site;
        out_dtype.
    """

    x: torch.Tensor
    weight: MXFP4Tensor
    bias: torch.Tensor | None
    site: str
    out_dtype: torch.dtype

    @property
    def weight_spec(self) -> QuantSpec:
        return MXFP4_WEIGHT

    @classmethod
    def from_args(cls, *, x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None,
                  site: str) -> "MXFP4LinearCall":
        w = MXFP4Tensor(codes=w_codes, scales=w_scales, shape=torch.Size((w_codes.shape[0], w_codes.shape[1] * 2)),
                        orig_dtype=torch.bfloat16)
        return cls(x=x, weight=w, bias=bias, site=site, out_dtype=x.dtype)

    def to_args(self) -> dict[str, Any]:
        return {"x": self.x, "w_codes": self.weight.codes, "w_scales": self.weight.scales, "bias": self.bias,
                "site": self.site}

    @classmethod
    def lowering_args(cls, weight: QuantSpec, act: QuantSpec | None, site: str) -> dict[str, Any]:
        """No option arguments. Raises: QpassError if an activation spec is given (weight-only op)."""
        if act is not None:
            raise QpassError(f"site {site}: qpass::mxfp4_linear is weight-only; it cannot quantize activations as {act.key}")
        return {}
