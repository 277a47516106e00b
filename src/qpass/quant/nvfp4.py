"""NVFP4 reference quantizer (SPEC §3): the one semantics every qpass path shares.

Plain torch, CPU or CUDA. Every step is an IEEE float32 operation with one rounding (no FMA
contraction is possible: each line is its own kernel), in this order:

    amax  = max|x| over the quantization group            (or per row: per_token activations)
    S_enc = fl(2688 / amax); S_enc = min(S_enc, FLT_MAX); amax == 0 or S_enc == 0 -> S_enc = 1
    S_dec = fl(1 / S_enc)                                  decode multiplier
    mult  = fl(S_enc * fl(1/6))                            fl(1/6) = 0x3E2AAAAB
    per block of 16 along K:
      s_b = e4m3_rne_satfinite(min(fl(vmax * mult), 448))  (subnormal scale bytes kept; may be 0)
      enc = min(fl(1 / fl(s_b * S_dec)), FLT_MAX)          s_b == 0 -> FLT_MAX
      q_i = e2m1_rne(clamp(fl(x_i * enc), -6, 6))
    dequant: bf16_rne(fl(fl(e2m1(q) * s_b) * S_dec))     (a dense tensor: nvfp4_dequantize)
    GEMM operand (SPEC §3.1): B = e2m1(q) * s_b, exact; S_dec goes to the GEMM's alpha (nvfp4_operand)

Source: TransformerEngine reference recipe (``reference_nvfp4.py``), reproduced bit for bit by
FlashInfer's exact mode; see ``prior-art/nvfp4_semantics.md`` §10.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from qpass.errors import QuantizationError
from qpass.formats.e2m1 import e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1
from qpass.formats.e4m3 import e4m3_round_magnitude
from qpass.formats.fp32 import FLT_MAX, FP4_E2M1_MAX, FP8_E4M3_MAX, NVFP4_GLOBAL_NUMERATOR
from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_PER_TOKEN, NVFP4_ACT_STATIC, NVFP4_WEIGHT, NVFP4Spec
from qpass.quant.checks import check_float_input, describe, sync_checks_enabled
from qpass.quant.groups import allreduce_max, tensor_amax

BLOCK = 16
ONE_SIXTH = 1.0 / 6.0  # python double; torch rounds it once to float32 0x3E2AAAAB


@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor quantized to NVFP4.

    Attributes:
        codes: uint8 ``[..., K/2]``; element ``2j`` in the low nibble.
        scales: ``torch.float8_e4m3fn`` ``[..., K/16]``, linear layout; block scale *relative to*
            the global scale (value = code * scale * s_dec).
        s_dec: float32 decode global scale (a **multiplier**, ``fl(1/s_enc)``); shape ``()`` for
            a per-tensor/per-group scale or ``[..., 1]`` for per-token activations.
        shape: logical shape ``[..., K]`` of the unquantized tensor.
        orig_dtype: dtype of the unquantized tensor.
        spec: the format spec.
        s_enc: float32 encode global scale (``fl(2688/amax)``, clamped; a **divisor** for decode).
            Same shape as ``s_dec``. Stored because ``fl(1/s_dec) != s_enc`` for many amax values;
            None when rebuilt from stored bytes.
        amax: float32 amax the global scale was derived from (same shape as ``s_dec``), or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    s_dec: torch.Tensor
    shape: torch.Size
    orig_dtype: torch.dtype = torch.bfloat16
    spec: NVFP4Spec = NVFP4_WEIGHT
    s_enc: torch.Tensor | None = None
    amax: torch.Tensor | None = None

    @classmethod
    def from_parts(
        cls, codes: torch.Tensor, scales: torch.Tensor, s_dec: torch.Tensor, spec: NVFP4Spec = NVFP4_WEIGHT
    ) -> "NVFP4Tensor":
        """Rebuild from stored bytes (packed codes [..., K/2], e4m3 scales [..., K/16], fp32 s_dec).

        Args:
            codes: uint8 ``[..., K/2]``, element ``2j`` in the low nibble.
            scales: ``float8_e4m3fn`` or raw ``uint8`` bytes ``[..., K/16]`` (linear layout);
                uint8 is reinterpreted bit for bit (never converted by value).
            s_dec: float32 decode multiplier, shape ``()`` or ``[..., 1]``.
        Raises:
            QuantizationError: wrong dtypes or shapes that do not fit together.
        """
        if codes.dtype != torch.uint8:
            raise QuantizationError(f"packed NVFP4 codes must be uint8, got {codes.dtype}")
        if scales.dtype == torch.uint8:
            scales = scales.view(torch.float8_e4m3fn)
        if scales.dtype != torch.float8_e4m3fn:
            raise QuantizationError(f"NVFP4 scales must be float8_e4m3fn (or their uint8 bytes), got {scales.dtype}")
        shape = torch.Size((*codes.shape[:-1], codes.shape[-1] * 2))
        if scales.shape[:-1] != codes.shape[:-1] or scales.shape[-1] * BLOCK != shape[-1]:
            raise QuantizationError(f"scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)}")
        s_dec = torch.as_tensor(s_dec, dtype=torch.float32)
        return cls(codes=codes, scales=scales, s_dec=s_dec, shape=shape, spec=spec)

    def flushed_blocks(self) -> int:
        """Blocks with a non-zero element whose E4M3 scale underflowed to 0 (see :func:`flushed_blocks`)."""
        return flushed_blocks(self)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """See :func:`nvfp4_dequantize`."""
        return nvfp4_dequantize(self, dtype)

    def unpacked_codes(self) -> torch.Tensor:
        """uint8 codes ``[..., K]``, one per element."""
        return unpack_e2m1(self.codes)

    def to(self, device: torch.device | str) -> "NVFP4Tensor":
        """Copy of this tensor on ``device`` (bytes unchanged)."""
        return dataclasses.replace(
            self,
            codes=self.codes.to(device),
            scales=self.scales.to(device),
            s_dec=self.s_dec.to(device),
            s_enc=None if self.s_enc is None else self.s_enc.to(device),
            amax=None if self.amax is None else self.amax.to(device),
        )


def global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S_enc, S_dec)`` from a float32 amax tensor of any shape (SPEC §3).

    ``S_enc = min(fl(2688/amax), FLT_MAX)``, replaced by 1 where ``amax == 0`` or ``S_enc == 0``;
    ``S_dec = fl(1/S_enc)``. Both float32, same shape as ``amax``.
    """
    amax = amax.float()
    numer = torch.full_like(amax, NVFP4_GLOBAL_NUMERATOR)
    s_enc = torch.clamp(numer / amax, max=FLT_MAX)  # 2688/0 = inf -> FLT_MAX, then replaced below
    one = torch.ones_like(s_enc)
    s_enc = torch.where((amax == 0) | (s_enc == 0), one, s_enc)
    s_dec = one / s_enc
    return s_enc, s_dec


def block_scales(vmax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block-scale values (float32) from per-block max|x| and the encode global scale.

    ``s_b = e4m3_rne_satfinite(min(fl(vmax * fl(S_enc * fl(1/6))), 448))``. ``s_enc`` broadcasts
    against ``vmax`` (``()`` or ``[..., 1]``).
    """
    mult = s_enc * torch.full_like(s_enc, ONE_SIXTH)
    sf = torch.clamp(vmax * mult, max=FLT_MAX)
    return e4m3_round_magnitude(sf)


def element_multiplier(s_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """``enc = min(fl(1 / fl(s_b * S_dec)), FLT_MAX)``; a zero block scale gives FLT_MAX."""
    denom = s_b * s_dec
    return torch.clamp(torch.ones_like(denom) / denom, max=FLT_MAX)


def nvfp4_quantize(
    x: torch.Tensor,
    amax: torch.Tensor | float | None = None,
    *,
    group: Sequence[torch.Tensor] | None = None,
    process_group: object | None = None,
    spec: NVFP4Spec = NVFP4_WEIGHT,
    name: str | None = None,
    site: str | None = None,
) -> NVFP4Tensor:
    """Quantize to NVFP4 (E2M1 codes, E4M3 scale per 16 along K, FP32 global scale).

    Args:
        x: bf16/fp16/fp32, shape ``(..., K)`` with at least 2 dims, ``K % 16 == 0``, finite.
        amax: the global amax (float32; a **max-abs value**, not a scale; shape ``()`` or ``[1]``,
            or ``x.shape[:-1] + (1,)`` for per_token). ``None`` means
            ``max|x|`` over ``x`` and every tensor in ``group`` (per row if
            ``spec.global_scope == 'per_token'``). A given amax smaller than ``max|x|`` is stale
            (SPEC §3 rule 2) and raises.
        group: other members of ``x``'s quantization group (e.g. the k and v weights when ``x`` is
            q): the amax is taken over all of them, so each member quantizes as its slice of the
            fused tensor.
        process_group: ``torch.distributed`` group over which the quantization group is sharded;
            the amax is all-reduced with MAX so each shard quantizes exactly as its slice of the
            unsharded tensor (shard widths along K must be multiples of 16). With a ``per_token``
            spec the per-row amax is all-reduced element-wise, which is right only when every rank
            holds the same rows (K-sharded activations), never for row/token-sharded inputs.
        spec: :class:`NVFP4Spec` (weight / activation, per-tensor / per-token global scale).
        name, site: how errors name the tensor.
    Returns:
        :class:`NVFP4Tensor`: codes uint8 ``(..., K/2)`` low nibble = even k; scales e4m3
        ``(..., K/16)`` linear layout; ``s_dec`` float32 (decode multiplier) and ``s_enc``
        (encode divisor).
    Raises:
        QuantizationError: non-float dtype, fewer than 2 dims, empty tensor, ``K % 16 != 0``, NaN
            or inf in ``x`` or ``amax``, negative amax, or a stale amax (``amax < max|x|``).
    Source: SPEC.md §3 (TransformerEngine reference recipe).
    """
    check_float_input(x, op="nvfp4_quantize", multiple_of=BLOCK, name=name, site=site)
    per_token = spec.global_scope == "per_token"
    if group:
        for i, g in enumerate(group):
            check_float_input(g, op="nvfp4_quantize", multiple_of=None, min_dim=1, name=f"{name or 'x'}.group[{i}]", site=site)
    if amax is None:
        amax_t = tensor_amax(x, per_row=per_token)
        if group:
            if per_token:
                raise QuantizationError(f"per_token NVFP4 has no shared group amax ({describe(name, site)})")
            amax_t = torch.stack([amax_t] + [tensor_amax(g).to(amax_t.device) for g in group]).amax()
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        if not per_token and amax_t.numel() == 1:
            amax_t = amax_t.reshape(())  # a [1]-shaped amax (checkpoint convention) is a scalar
        _check_amax(amax_t, x, per_token, name, site)
    amax_t = allreduce_max(amax_t, process_group)
    if spec.arithmetic == "modelopt":
        return quantize_with_amax_modelopt(x, amax_t, spec=spec, name=name, site=site)
    return quantize_with_amax(x, amax_t, spec=spec)


def nvfp4_quantize_static(x: torch.Tensor, amax: torch.Tensor, *, spec: NVFP4Spec = NVFP4_ACT, name: str | None = None,
                          site: str | None = None) -> NVFP4Tensor:
    """Quantize an activation with a **static** (calibrated) per-tensor global amax (SPEC §3 arithmetic).

    The SPEC §3 formula with ``amax`` taken from calibration instead of ``max|x|``: ``S_enc =
    fl(2688/amax)``, ``S_dec = fl(1/S_enc)``, block scales ``min(fl(vmax * fl(S_enc/6)), 448)`` rounded
    to E4M3, elements clamped to ±6. Unlike :func:`nvfp4_quantize` an input larger than ``amax`` is
    not an error: that is what a static scale does when activations drift past the calibration
    (block scales saturate at 448, elements at ±6); how far they drift is reported, not refused.

    Args:
        x: bf16/fp16/fp32 ``(..., K)``, ``K % 16 == 0``, finite.
        amax: float32 calibrated amax, shape ``()`` or ``[1]``, finite and ``> 0``.
        spec: the activation spec recorded on the result (``NVFP4_ACT_STATIC`` in rollout graphs).
        name, site: how errors name the tensor.
    Returns:
        :class:`NVFP4Tensor` (``s_dec``, ``s_enc`` and ``amax`` of the calibrated amax).
    Raises:
        QuantizationError: bad ``x`` (as :func:`nvfp4_quantize`); ``amax`` not a float32 scalar, or
            (when value checks run) not finite and positive.
    Source: SPEC §3 (global-scale lines) with rule 5's global scale taken from calibration.
    """
    check_float_input(x, op="nvfp4_quantize_static", multiple_of=BLOCK, name=name, site=site)
    if spec.global_scope != "per_tensor":
        raise QuantizationError(f"a static activation scale is per tensor, got spec {spec.key} ({describe(name, site)})")
    a = torch.as_tensor(amax)
    if a.dtype != torch.float32 or a.numel() != 1:
        raise QuantizationError(f"static amax must be a float32 scalar, got {a.dtype}{tuple(a.shape)} ({describe(name, site)})")
    a = a.to(x.device).reshape(())
    if sync_checks_enabled(x.device) and not bool(torch.isfinite(a) & (a > 0)):
        raise QuantizationError(f"static amax must be finite and > 0, got {float(a)} ({describe(name, site)})")
    return quantize_with_amax(x, a, spec=spec)


MODELOPT_MIN_BLOCK_SCALE = 2.0**-9  # ModelOpt 0.47 _cast_per_block_scale_to_fp8: clamp(min=2**-9, max=448)


def quantize_with_amax_modelopt(x: torch.Tensor, amax: torch.Tensor, *, spec: NVFP4Spec, name: str | None = None,
                                site: str | None = None) -> NVFP4Tensor:
    """NVIDIA ModelOpt 0.47's NVFP4 weight export arithmetic (CPU eager), for an already-final amax::

        S_dec = fl(amax / 2688)                          weight_scale_2 (decode multiplier)
        sf    = fl(vmax / fl(6 * S_dec));  sf == 0 -> 1.0
        s_b   = e4m3_rne(clamp(sf, 2^-9, 448))
        q     = e2m1_rne_sat(fl(x / fl(s_b * S_dec)))

    ``S_enc`` is reported as ``fl(1/S_dec)`` (ModelOpt stores no encode scale; it is what a loader
    inverts). Decoding is the same as for every NVFP4 tensor (:func:`nvfp4_dequantize`). Per-tensor
    amax only (weights).

    Raises:
        QuantizationError: ``amax == 0`` (ModelOpt divides by ``S_dec = 0``: NaN block scales) or
            a per-row amax, naming the tensor.
    Source: Model-Optimizer 0.47.0 ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``
    (``get_weights_scaling_factor_2``, ``get_weights_scaling_factor``, ``_cast_per_block_scale_to_fp8``,
    ``quantize``, ``_cast_fp4``), read from the installed wheel; checked byte for byte against a
    real ModelOpt export in ``tests/test_export.py``.
    """
    amax = amax.float()
    if amax.dim() != 0:
        raise QuantizationError(f"the modelopt NVFP4 arithmetic takes one per-tensor amax ({describe(name, site)})")
    if not bool(amax > 0):
        raise QuantizationError(f"the modelopt NVFP4 arithmetic has no bytes for amax == 0 ({describe(name, site)}: "
                                "ModelOpt would divide by weight_scale_2 = 0)")
    s_dec = amax / torch.full_like(amax, FP4_E2M1_MAX * FP8_E4M3_MAX)
    xb, vmax = blocks_and_vmax(x)
    sf = vmax / (torch.full_like(s_dec, FP4_E2M1_MAX) * s_dec)
    sf = torch.where(sf == 0, torch.ones_like(sf), sf)
    s_b = e4m3_round_magnitude(torch.clamp(sf, min=MODELOPT_MIN_BLOCK_SCALE, max=FP8_E4M3_MAX))
    y = torch.clamp(xb / (s_b * s_dec).unsqueeze(-1), -FP4_E2M1_MAX, FP4_E2M1_MAX)
    return encode_scaled(x, y, s_b, s_dec=s_dec, s_enc=torch.ones_like(s_dec) / s_dec, amax=amax, spec=spec)


def quantize_with_amax(x: torch.Tensor, amax: torch.Tensor, *, spec: NVFP4Spec = NVFP4_WEIGHT) -> NVFP4Tensor:
    """The arithmetic of :func:`nvfp4_quantize` after validation (SPEC §3), for an already-final amax.

    Shared by :func:`nvfp4_quantize` and the ``te_reference`` emulation mode so the two cannot drift
    apart. Performs **no** input checks: ``x`` must be finite bf16/fp16/fp32 ``(..., K)`` with
    ``K % 16 == 0``; ``amax`` float32, shape ``()`` or ``x.shape[:-1] + (1,)``, finite, ``>= 0``.
    A stale amax (``< max|x|``) is *not* rejected here: block scales then saturate at 448 and
    elements at +-6, exactly as the formula says.
    """
    amax = amax.float()
    s_enc, s_dec = global_scales(amax)
    xb, vmax = blocks_and_vmax(x)
    s_b = block_scales(vmax, s_enc)
    enc = element_multiplier(s_b, s_dec)
    y = torch.clamp(xb * enc.unsqueeze(-1), -6.0, 6.0)
    return encode_scaled(x, y, s_b, s_dec=s_dec, s_enc=s_enc, amax=amax, spec=spec)


def blocks_and_vmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (..., K)`` as float32 blocks ``(..., K/16, 16)`` and their max-abs ``vmax (..., K/16)``.

    No checks: ``K % 16 == 0`` is the caller's (every quantizer validates first).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    xb = x.float().reshape(*lead, k // BLOCK, BLOCK)
    return xb, xb.abs().amax(dim=-1)


def encode_scaled(
    x: torch.Tensor, y: torch.Tensor, s_b: torch.Tensor, *, s_dec: torch.Tensor, s_enc: torch.Tensor,
    amax: torch.Tensor, spec: NVFP4Spec,
) -> NVFP4Tensor:
    """E2M1-encode the already scaled and clamped float32 blocks ``y (..., K/16, 16)`` of ``x`` and
    wrap them with their scales in an :class:`NVFP4Tensor` (the last step of every NVFP4 quantizer).

    Args:
        x: the tensor being quantized (gives ``shape`` and ``orig_dtype``), ``(..., K)``.
        y: float32 ``x / (s_b * S_dec)`` in ``[-6, 6]``, no NaN.
        s_b: float32 block scales ``(..., K/16)``, E4M3-representable (cast to ``float8_e4m3fn``).
        s_dec, s_enc, amax, spec: stored as given.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    codes = e2m1_encode(y).reshape(*lead, k)
    return NVFP4Tensor(
        codes=pack_e2m1(codes),
        scales=s_b.to(torch.float8_e4m3fn),
        s_dec=s_dec,
        s_enc=s_enc,
        amax=amax,
        shape=x.shape,
        orig_dtype=x.dtype,
        spec=spec,
    )


def _check_amax(amax: torch.Tensor, x: torch.Tensor, per_token: bool, name: str | None, site: str | None) -> None:
    where = describe(name, site)
    expected = () if not per_token else tuple(x.shape[:-1]) + (1,)
    if amax.dim() != 0 and tuple(amax.shape) != expected:
        raise QuantizationError(f"amax shape {tuple(amax.shape)} does not match {expected} for {where}")
    if not sync_checks_enabled(x.device):
        return
    if not bool(torch.isfinite(amax).all()) and bool(torch.isfinite(x).all()):
        # x itself was checked finite: the NaN/inf is in another member of x's quantization group
        raise QuantizationError(
            f"the group amax {amax.flatten()[:4].tolist()} given for {where} is not finite, but this tensor is: "
            "another member of its quantization group (fused q/k/v or gate/up) has NaN/inf"
        )
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise QuantizationError(f"amax must be finite and >= 0, got {amax.flatten()[:4].tolist()} for {where}")
    actual = tensor_amax(x, per_row=per_token)
    if bool((amax < actual).any()):
        raise QuantizationError(
            f"stale amax for {where}: given amax={float(amax.max()):.9g} < current max|x|={float(actual.max()):.9g}; "
            "block scales would exceed 448 and saturate (SPEC §3 rule 2: recompute amax from the current tensor)"
        )


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode an :class:`NVFP4Tensor`: ``to_dtype(fl(fl(e2m1(q) * s_b) * S_dec))``.

    The materialised dense value (SPEC §3 ``dequant``): what a consumer that needs a dense tensor
    gets (the ``plain`` export, activation QDQ, the RAC residual ``R = X - DQ(Q_A(X))``). A GEMM
    multiplies :func:`nvfp4_operand` instead and applies ``S_dec`` once to its output (SPEC §3.1).

    Args:
        q: the quantized tensor.
        dtype: output dtype; ``torch.float32`` returns the exact float32 value before the final
            cast, ``torch.bfloat16`` (default) rounds it once, to nearest even.
    Returns:
        Tensor of ``q.shape`` and ``dtype``.
    """
    out = nvfp4_operand(q, torch.float32) * q.s_dec
    return out if dtype == torch.float32 else out.to(dtype)


def nvfp4_operand(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The GEMM operand ``B = e2m1(q) * s_b`` of an NVFP4 tensor (SPEC §3.1): the decode without the
    per-tensor scale, which a GEMM applies once, in its epilogue ``alpha``.

    Exact in bf16, fp16 and fp32: at most 6 significant bits (2 of the E2M1 value, 4 of the E4M3
    scale), ``|B|`` in ``[2^-10, 2688]`` or 0, so the float32 product rounds nothing and the cast to
    ``dtype`` is exact (``tests/test_factored_decode.py`` checks all 16 codes x 256 scale bytes).

    Args:
        q: the quantized tensor ``[..., K]``.
        dtype: bf16, fp16 or fp32 (default float32, what the reference GEMMs multiply).
    Returns:
        Tensor of ``q.shape`` and ``dtype``.
    """
    vals = e2m1_decode(unpack_e2m1(q.codes))
    lead, k = vals.shape[:-1], vals.shape[-1]
    s = q.scales.to(torch.float32).unsqueeze(-1)
    out = (vals.reshape(*lead, k // BLOCK, BLOCK) * s).reshape(*lead, k)
    return out if dtype == torch.float32 else out.to(dtype)


@functools.lru_cache(maxsize=None)
def act_operand_limit(act_dtype: torch.dtype) -> float:
    """Largest bf16 value not above the finite range of ``act_dtype`` (and of bf16): the bound of a
    W4A4 activation operand (:func:`nvfp4_act_operand`).

    fp16: 65280 (``0x477F``; the bf16 neighbours of the fp16 max 65504 are 65280 and 65536, and
    65536 is inf in fp16); bf16 and fp32: the bf16 max 3.3895e38 (``0x7F7F``).
    """
    lim = min(torch.finfo(act_dtype).max, torch.finfo(torch.bfloat16).max)
    b = torch.tensor(lim, dtype=torch.float32).to(torch.bfloat16)
    if float(b) > lim:  # RNE rounded up: take the bf16 value one below
        b = (b.view(torch.int16) - 1).view(torch.bfloat16)
    return float(b)


def nvfp4_act_operand(q: NVFP4Tensor, act_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The bf16 activation operand of a W4A4 GEMM: ``to_bf16_rne(min(max(v, -L), L))`` with
    ``v = fl(fl(e2m1(q) * s_b) * S_dec)`` and ``L = act_operand_limit(act_dtype)``.

    The SPEC §3 decode rounded to bf16, saturated so that it never exceeds the finite range of the
    activation dtype (``act_dtype``, default ``q.orig_dtype``): fp16 activations at 65504 decode to
    ~65504.0002, which bf16 rounds to 65536 (inf in fp16), so a W4A4 output could overflow where the
    fp16 model's does not; the operand is 65280 (the bf16 value below) instead. Clamping the float32
    value before the one rounding equals rounding first and saturating after (``L`` is a bf16 value).
    For bf16 and fp32 activations only values beyond the bf16 range change (``satfinite``, as the
    E4M3 block scales).

    Args:
        q: a quantized activation ``[..., K]`` (``nvfp4_quantize(x, spec=NVFP4_ACT...)``).
        act_dtype: dtype of the activation (default ``q.orig_dtype``).
    Returns:
        bf16 tensor of ``q.shape``.
    Source: SPEC §3 dequant line + rule 5 (activations); same operand in ``qpass.quant.rac``, the
    Triton kernels (``kernels/nvfp4_quant.py``, ``kernels/rac.py``) and the SGLang row-parallel path.
    """
    lim = act_operand_limit(act_dtype or q.orig_dtype)
    return nvfp4_dequantize(q, torch.float32).clamp(-lim, lim).to(torch.bfloat16)


def nvfp4_qdq_reference(x: torch.Tensor, amax: torch.Tensor | None = None, *, spec: NVFP4Spec = NVFP4_WEIGHT) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x.dtype`` (the learner's fake-quant forward, no autograd)."""
    return nvfp4_dequantize(nvfp4_quantize(x, amax, spec=spec), x.dtype)


def nvfp4_act_spec(per_token: bool, static: bool = False) -> NVFP4Spec:
    """The activation spec for a dynamic per-tensor or per-token global scale, or a static (calibrated) one.

    Raises:
        QuantizationError: ``per_token`` and ``static`` together (a calibrated scale is per tensor).
    """
    if static:
        if per_token:
            raise QuantizationError("a static (calibrated) activation scale is per tensor; per_token has none")
        return NVFP4_ACT_STATIC
    return NVFP4_ACT_PER_TOKEN if per_token else NVFP4_ACT


def nvfp4_act_quantize(x: torch.Tensor, spec: NVFP4Spec, *, act_amax: torch.Tensor | None = None, site: str | None = None,
                       name: str = "activation") -> NVFP4Tensor:
    """The rollout's activation quantizer: dynamic (``spec.global_source == 'dynamic'``: the amax of ``x``,
    per tensor or per token) or static (the calibrated ``act_amax``, :func:`nvfp4_quantize_static`).

    Raises:
        QuantizationError: a static spec without ``act_amax`` (or a dynamic one with it); see the quantizers.
    """
    if spec.global_source == "static":
        if act_amax is None:
            raise QuantizationError(f"static activation scale at site {site}: no calibrated amax given")
        return nvfp4_quantize_static(x, act_amax, spec=spec, name=name, site=site)
    if act_amax is not None:
        raise QuantizationError(f"site {site}: a calibrated act_amax was given for the dynamic activation spec {spec.key}")
    return nvfp4_quantize(x, spec=spec, name=name, site=site)


def flushed_blocks(q: NVFP4Tensor) -> int:
    """Number of 1x16 blocks with a non-zero element whose E4M3 scale byte underflowed to 0.

    Such a block decodes to all zeros (SPEC §3 ``ZeroScaleRule.KEEP_ZERO``: the scale stays 0 and
    the codes saturate). Counted from the quantized tensor alone: a flushed block has scale byte 0
    and at least one non-zero code magnitude (an all-zero block encodes to magnitude 0).
    """
    mag = unpack_e2m1(q.codes) & 7
    lead, k = mag.shape[:-1], mag.shape[-1]
    nonzero = (mag.reshape(*lead, k // BLOCK, BLOCK) != 0).any(dim=-1)
    return int(((q.scales.view(torch.uint8) == 0) & nonzero).sum())


def _register_tables() -> None:
    from qpass.tables import register

    @register("reference", NVFP4Spec)
    def _nvfp4_reference(spec: NVFP4Spec, x: torch.Tensor, *, amax: torch.Tensor | None = None,
                         site: str | None = None, name: str | None = None) -> NVFP4Tensor:
        """``nvfp4_quantize``; ``amax`` (group amax) is used by weight specs only."""
        return nvfp4_quantize(x, amax if spec.has_global_scale else None, spec=spec, site=site, name=name)


_register_tables()
