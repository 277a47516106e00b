"""Quantization format specs: one frozen dataclass per format, conventions as explicit fields.

A spec says *what* a quantized tensor means (element format, block shape, scale format, how the
global scale is stored, layout, tie and zero rules). It carries no code; the quantizers in
:mod:`qpass.quant` and the spec tables in :mod:`qpass.tables` are keyed by spec type.

Source: ``SPEC.md`` §3 (NVFP4 reference recipe = TransformerEngine reference recipe; FP8 E4M3
DeepSeek-style blocks), OCP Microscaling Formats v1.0 (MXFP4).
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Literal


class GlobalScaleConvention(str, Enum):
    """How a checkpoint stores the FP32 per-tensor global scale.

    ``DECODE_MULTIPLIER``: ``S_dec`` such that ``value = code * s_b * S_dec`` (ModelOpt
    ``weight_scale_2``/``input_scale``). ``ENCODE_DIVISOR``: ``S_enc = 2688 / amax`` such that
    ``value = code * s_b / S_enc`` (compressed-tensors ``weight_global_scale``). The two are not
    reciprocal in FP32 for ~24 % of amax values, so qpass stores both bit patterns.
    """

    DECODE_MULTIPLIER = "decode_multiplier"
    ENCODE_DIVISOR = "encode_divisor"


class ScaleLayout(str, Enum):
    """Memory layout of block-scale bytes: ``linear`` [R, K/16] or the cuBLAS/CUTLASS 128x4 swizzle."""

    LINEAR = "linear"
    SWIZZLED_128X4 = "swizzled_128x4"


class TieRule(str, Enum):
    """Rounding of an exact midpoint between two representable values."""

    NEAREST_EVEN = "nearest_even"
    TOWARD_ZERO = "toward_zero"  # DeepGEMM FP4 reference
    AWAY_FROM_ZERO = "away_from_zero"  # MSLK ROCm fallback


class ZeroScaleRule(str, Enum):
    """What a block whose E4M3 scale rounds to 0 does.

    ``KEEP_ZERO``: the byte 0 is stored and the element multiplier becomes FLT_MAX (TE reference:
    codes saturate, values decode to 0). Other libraries clamp the scale away from 0; those live in
    :mod:`qpass.quant.emulation`.
    """

    KEEP_ZERO = "keep_zero"


class Granularity(str, Enum):
    """Which elements share one scale."""

    PER_TENSOR = "per_tensor"
    PER_TOKEN = "per_token"  # one scale per row (all leading dims flattened)
    BLOCK_1X16 = "block_1x16"
    BLOCK_1X32 = "block_1x32"
    BLOCK_1X128 = "block_1x128"
    BLOCK_128X128 = "block_128x128"


@dataclasses.dataclass(frozen=True)
class NVFP4Spec:
    """NVFP4: E2M1 elements, one E4M3 scale per 16 contiguous elements along K, FP32 global scale.

    Fields:
        global_scope: ``per_tensor`` (weights; dynamic activations) or ``per_token`` (one global
            scale per row: activations only).
        role: ``weight`` (quantized once per sync, shared learner/rollout) or ``activation``
            (quantized on every forward, rollout only).
        global_scale: how exported checkpoints store the global scale (both bit patterns are kept
            in memory; this only picks the exported name).
        scale_layout: layout of exported scale bytes.
        arithmetic: which quantizer arithmetic produces the bytes (weights only): ``te_reference``
            (SPEC §3, TransformerEngine reference: ``S_enc = fl(2688/amax)``, ``S_dec = fl(1/S_enc)``)
            or ``modelopt`` (NVIDIA ModelOpt 0.47 export: ``S_dec = weight_scale_2 = fl(amax/2688)``,
            block scale ``fl(vmax/fl(6*S_dec))`` (exact 0 -> 1.0) clamped to ``[2^-9, 448]``,
            element ``fl(x/fl(s_b*S_dec))``; see :func:`qpass.quant.nvfp4.quantize_with_amax_modelopt`).
            Learner QDQ, rollout lowering and sync all quantize with the spec's arithmetic, so a
            recipe that selects ``modelopt`` on both sides keeps bit-level parity.
        global_source: where a per-tensor activation global scale comes from: ``dynamic`` (the
            amax of the current input, SPEC §3 rule 5) or ``static`` (a calibrated amax, the
            ``input_scale`` of ModelOpt / vLLM ``modelopt_fp4`` checkpoints: an input beyond it
            saturates block scales at 448 and elements at ±6, exactly as the SPEC §3 formula says).
            Activations with a per-tensor scope only.
    """

    name: Literal["nvfp4"] = "nvfp4"
    role: Literal["weight", "activation"] = "weight"
    global_scope: Literal["per_tensor", "per_token"] = "per_tensor"
    block_size: int = 16
    element: Literal["e2m1"] = "e2m1"
    scale_format: Literal["e4m3"] = "e4m3"
    global_scale: GlobalScaleConvention = GlobalScaleConvention.DECODE_MULTIPLIER
    scale_layout: ScaleLayout = ScaleLayout.LINEAR
    tie_rule: TieRule = TieRule.NEAREST_EVEN
    zero_scale_rule: ZeroScaleRule = ZeroScaleRule.KEEP_ZERO
    nibble_order: Literal["low_even"] = "low_even"
    arithmetic: Literal["te_reference", "modelopt"] = "te_reference"
    global_source: Literal["dynamic", "static"] = "dynamic"

    def __post_init__(self) -> None:
        if self.global_source not in ("dynamic", "static"):
            raise ValueError(f"NVFP4 global_source must be 'dynamic' or 'static', got {self.global_source!r}")
        if self.global_source == "static" and (self.role != "activation" or self.global_scope != "per_tensor"):
            raise ValueError("a static (calibrated) NVFP4 global scale is for per-tensor activations only "
                             "(weights recompute their amax at every quantization, SPEC §3 rule 2)")
        if self.arithmetic not in ("te_reference", "modelopt"):
            raise ValueError(f"NVFP4 arithmetic must be 'te_reference' or 'modelopt', got {self.arithmetic!r}")
        if self.arithmetic == "modelopt" and self.role != "weight":
            raise ValueError("the modelopt NVFP4 arithmetic is a weight quantizer (activations use the te_reference one)")
        if self.block_size != 16:
            raise ValueError(f"NVFP4 uses 1x16 blocks, got block_size={self.block_size}; use MXFP4Spec for 1x32")
        if self.role == "weight" and self.global_scope != "per_tensor":
            raise ValueError("NVFP4 weights use a per-tensor (per-group) global scale; per_token is for activations")

    @property
    def key(self) -> str:
        """Stable string id used in reports and lowering tables, e.g. ``nvfp4.weight.per_tensor``
        (``nvfp4.weight.per_tensor.modelopt`` for the ModelOpt arithmetic,
        ``nvfp4.activation.per_tensor.static`` for a calibrated activation scale)."""
        base = f"{self.name}.{self.role}.{self.global_scope}"
        if self.global_source == "static":
            base += ".static"
        return base if self.arithmetic == "te_reference" else f"{base}.{self.arithmetic}"

    @property
    def has_global_scale(self) -> bool:
        """Weights: one FP32 global scale from the *group* amax (shared by a fused group, SPEC §3 rule 1)."""
        return self.role == "weight"


@dataclasses.dataclass(frozen=True)
class MXFP4Spec:
    """MXFP4 (OCP MX v1.0): E2M1 elements, one E8M0 power-of-two scale per 32 elements, no global scale."""

    name: Literal["mxfp4"] = "mxfp4"
    role: Literal["weight", "activation"] = "weight"
    block_size: int = 32
    element: Literal["e2m1"] = "e2m1"
    scale_format: Literal["e8m0"] = "e8m0"
    tie_rule: TieRule = TieRule.NEAREST_EVEN
    nibble_order: Literal["low_even"] = "low_even"

    def __post_init__(self) -> None:
        if self.block_size != 32:
            raise ValueError(f"MXFP4 uses 1x32 blocks, got block_size={self.block_size}")

    @property
    def key(self) -> str:
        return f"{self.name}.{self.role}"

    has_global_scale = False


@dataclasses.dataclass(frozen=True)
class FP8Spec:
    """FP8 E4M3 with FP32 decode scales (``scale = amax / 448``, a multiplier).

    Granularities: ``per_tensor``, ``per_token`` (one scale per row), ``block_1x128`` (activations,
    DeepSeek style; a partial last block along K is allowed) and ``block_128x128`` (weights; partial
    edge blocks allowed). Element: ``e4m3_rne_satfinite(x * fl(1/scale))``.

    Fields:
        zero_amax_scale: scale used when ``amax == 0`` or ``amax/448`` underflows to 0 (default 1.0,
            so zeros encode as zeros instead of ``0 * inf = NaN``).
    """

    name: Literal["fp8_e4m3"] = "fp8_e4m3"
    role: Literal["weight", "activation"] = "weight"
    granularity: Granularity = Granularity.PER_TENSOR
    scale_kind: Literal["decode_multiplier"] = "decode_multiplier"
    element_op: Literal["mul_reciprocal"] = "mul_reciprocal"
    zero_amax_scale: float = 1.0

    def __post_init__(self) -> None:
        allowed = {Granularity.PER_TENSOR, Granularity.PER_TOKEN, Granularity.BLOCK_1X128, Granularity.BLOCK_128X128}
        if Granularity(self.granularity) not in allowed:
            raise ValueError(
                f"FP8 granularity must be one of {sorted(g.value for g in allowed)}, got {self.granularity!r}"
            )
        object.__setattr__(self, "granularity", Granularity(self.granularity))

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """(rows, cols) of one scale block, or None for per-tensor / per-token."""
        return {Granularity.BLOCK_1X128: (1, 128), Granularity.BLOCK_128X128: (128, 128)}.get(self.granularity)

    @property
    def key(self) -> str:
        return f"{self.name}.{self.role}.{self.granularity.value}"

    has_global_scale = False


QuantSpec = NVFP4Spec | MXFP4Spec | FP8Spec

# The canonical specs the recipes refer to by name.
NVFP4_WEIGHT = NVFP4Spec(role="weight")
# Not in ALL_SPECS (the backends' claims): only the reference quantizer implements this arithmetic;
# backends keyed by canonical spec keys (Triton quantizers, ONNX emitters) refuse it by name.
NVFP4_WEIGHT_MODELOPT = NVFP4Spec(role="weight", arithmetic="modelopt")
NVFP4_ACT = NVFP4Spec(role="activation", global_scope="per_tensor")
NVFP4_ACT_PER_TOKEN = NVFP4Spec(role="activation", global_scope="per_token")
# Not in ALL_SPECS either: a calibrated (static) per-tensor activation scale runs on the reference
# kernels only; backends keyed by canonical spec keys refuse it by name.
NVFP4_ACT_STATIC = NVFP4Spec(role="activation", global_scope="per_tensor", global_source="static")
MXFP4_WEIGHT = MXFP4Spec(role="weight")
FP8_WEIGHT_BLOCK = FP8Spec(role="weight", granularity=Granularity.BLOCK_128X128)
FP8_ACT_BLOCK = FP8Spec(role="activation", granularity=Granularity.BLOCK_1X128)
FP8_WEIGHT_PER_TENSOR = FP8Spec(role="weight", granularity=Granularity.PER_TENSOR)
FP8_ACT_PER_TOKEN = FP8Spec(role="activation", granularity=Granularity.PER_TOKEN)

ALL_SPECS: tuple[QuantSpec, ...] = (
    NVFP4_WEIGHT,
    NVFP4_ACT,
    NVFP4_ACT_PER_TOKEN,
    MXFP4_WEIGHT,
    FP8_WEIGHT_BLOCK,
    FP8_ACT_BLOCK,
    FP8_WEIGHT_PER_TENSOR,
    FP8_ACT_PER_TOKEN,
)


# The NVFP4 activation *modes*: the ``act`` argument of ``qpass::nvfp4_linear``, the ``act`` option of
# ``w4a4_lower`` and of the ``qpass_nvfp4`` checkpoint config. The one place a mode string meets its spec.
# NVFP4_ACT_MODES are the dynamic ones a recipe's ``act`` and a checkpoint config may name;
# NVFP4_OP_ACT_MODES adds ``nvfp4_static`` (a calibrated per-tensor scale, ``w4a4_lower`` with
# ``act_scale: static``), which exists only in rollout graphs (the op's ``act`` with its ``act_amax``
# constant) and what is derived from them (reports, export sites); the engine plugins do not serve it.
NVFP4ActMode = Literal["nvfp4", "nvfp4_per_token", "none"]
NVFP4_ACT_MODES: dict[str, NVFP4Spec | None] = {"nvfp4": NVFP4_ACT, "nvfp4_per_token": NVFP4_ACT_PER_TOKEN, "none": None}
NVFP4OpActMode = Literal["nvfp4", "nvfp4_per_token", "nvfp4_static", "none"]
NVFP4_OP_ACT_MODES: dict[str, NVFP4Spec | None] = {**NVFP4_ACT_MODES, "nvfp4_static": NVFP4_ACT_STATIC}


def nvfp4_act_spec_of(mode: str, where: str = "") -> NVFP4Spec | None:
    """The activation spec of an NVFP4 activation mode of the op (:data:`NVFP4_OP_ACT_MODES`;
    ``none`` -> None: W4A16). Recipe and checkpoint options are validated against
    :data:`NVFP4_ACT_MODES` before they get here.

    Raises:
        ValueError: unknown mode; names ``where`` (a site, an option) and the known modes.
    """
    try:
        return NVFP4_OP_ACT_MODES[mode]
    except (KeyError, TypeError):
        raise ValueError(f"{where + ': ' if where else ''}NVFP4 activation mode must be one of {list(NVFP4_OP_ACT_MODES)}, "
                         f"got {mode!r}") from None


def nvfp4_act_mode(spec: QuantSpec | None) -> str:
    """The NVFP4 activation mode of an activation spec (None -> ``none``; ``NVFP4_ACT_STATIC`` ->
    ``nvfp4_static``).

    Raises:
        ValueError: ``spec`` is not an NVFP4 activation spec.
    """
    for mode, s in NVFP4_OP_ACT_MODES.items():
        if s == spec:
            return mode
    raise ValueError(f"{spec.key if spec is not None else spec} is not an NVFP4 activation spec "
                     f"(modes: {list(NVFP4_OP_ACT_MODES)})")


def nvfp4_weight_spec(arithmetic: str = "te_reference") -> NVFP4Spec:
    """The canonical NVFP4 weight spec of ``arithmetic`` (``te_reference`` | ``modelopt``).

    Raises:
        ValueError: unknown arithmetic.
    """
    specs = {"te_reference": NVFP4_WEIGHT, "modelopt": NVFP4_WEIGHT_MODELOPT}
    if arithmetic not in specs:
        raise ValueError(f"NVFP4 weight arithmetic must be one of {sorted(specs)}, got {arithmetic!r}")
    return specs[arithmetic]


def spec_by_key(key: str) -> QuantSpec:
    """Look up a canonical spec by its ``key`` (``nvfp4.weight.per_tensor`` ...; also
    ``nvfp4.weight.per_tensor.modelopt``).

    Raises:
        KeyError: unknown key; the message lists the known ones.
    """
    for spec in (*ALL_SPECS, NVFP4_WEIGHT_MODELOPT):
        if spec.key == key:
            return spec
    raise KeyError(f"unknown quantization spec {key!r}; known: {[s.key for s in ALL_SPECS]}")
