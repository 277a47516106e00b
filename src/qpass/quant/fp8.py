"""FP8 E4M3 reference quantizer (SPEC §3, last paragraph).

``scale = fl(amax / 448)`` (float32 **decode multiplier**; ``scale == 0`` -> ``spec.zero_amax_scale``),
``inv = min(fl(1/scale), FLT_MAX)``, element ``= e4m3_rne_satfinite(fl(x * inv))``,
dequant ``= fl(float(e) * scale)``. Granularities: per tensor, per token (row), 1x128 blocks along
K (DeepSeek-style activations) and 128x128 blocks (weights); partial edge blocks are allowed and
take the amax of the elements they hold.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from qpass.formats.e4m3 import e4m3_round
from qpass.formats.fp32 import FLT_MAX, FP8_E4M3_MAX
from qpass.formats.spec import FP8Spec, Granularity
from qpass.quant.checks import check_float_input


@dataclasses.dataclass(frozen=True)
class FP8Tensor:
    """A tensor quantized to FP8 E4M3.

    Attributes:
        data: ``torch.float8_e4m3fn``, same shape as the input.
        scale: float32 decode multipliers: ``()`` per tensor, ``[R, 1]`` per token,
            ``[R, ceil(K/128)]`` for 1x128 blocks, ``[ceil(R/128), ceil(K/128)]`` for 128x128
            (R = product of leading dims).
        shape, orig_dtype, spec: logical shape, input dtype, format spec.
    """

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    orig_dtype: torch.dtype
    spec: FP8Spec

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """See :func:`fp8_dequantize`."""
        return fp8_dequantize(self, dtype)


def _expand_scale(scale: torch.Tensor, spec: FP8Spec, rows: int, k: int) -> torch.Tensor:
    """Broadcast a scale tensor to element shape [rows, k]."""
    g = spec.granularity
    if g == Granularity.PER_TENSOR:
        return scale.expand(rows, k)
    if g == Granularity.PER_TOKEN:
        return scale.expand(rows, k)
    br, bc = spec.block_shape
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :k]


def _block_amax(x2: torch.Tensor, spec: FP8Spec) -> torch.Tensor:
    rows, k = x2.shape
    a = x2.abs()
    g = spec.granularity
    if g == Granularity.PER_TENSOR:
        return a.amax().float()
    if g == Granularity.PER_TOKEN:
        return a.amax(dim=-1, keepdim=True).float()
    br, bc = spec.block_shape
    rp, kp = math.ceil(rows / br) * br, math.ceil(k / bc) * bc
    padded = torch.zeros(rp, kp, dtype=torch.float32, device=x2.device)
    padded[:rows, :k] = a.float()  # zero padding never changes a max of |x|
    return padded.reshape(rp // br, br, kp // bc, bc).amax(dim=(1, 3))


def fp8_quantize(
    x: torch.Tensor,
    granularity: Granularity | str = Granularity.PER_TENSOR,
    *,
    spec: FP8Spec | None = None,
    name: str | None = None,
    site: str | None = None,
) -> FP8Tensor:
    """Quantize to FP8 E4M3 with float32 decode scales.

    Args:
        x: bf16/fp16/fp32, shape ``(..., K)``, at least 2 dims (``block_128x128`` needs exactly
            2), finite.
        granularity: ``per_tensor``, ``per_token``, ``block_1x128`` or ``block_128x128``
            (ignored when ``spec`` is given).
        spec: full :class:`FP8Spec`; overrides ``granularity``.
        name, site: how errors name the tensor.
    Returns:
        :class:`FP8Tensor` (data e4m3 same shape as x; scale float32 decode multipliers).
    Raises:
        QuantizationError: non-float dtype, fewer than 2 dims, empty, NaN/inf, or a 128x128
            request on a tensor that is not 2-D.
    """
    spec = spec or FP8Spec(granularity=Granularity(granularity))
    check_float_input(x, op="fp8_quantize", name=name, site=site)
    if spec.granularity == Granularity.BLOCK_128X128 and x.dim() != 2:
        from qpass.errors import QuantizationError

        raise QuantizationError(f"block_128x128 FP8 needs a 2-D weight, got shape={tuple(x.shape)} ({name or site or 'input'})")
    k = x.shape[-1]
    x2 = x.float().reshape(-1, k)
    amax = _block_amax(x2, spec)
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    scale = torch.where(scale == 0, torch.full_like(scale, spec.zero_amax_scale), scale)
    inv = torch.clamp(torch.ones_like(scale) / scale, max=FLT_MAX)
    y = x2 * _expand_scale(inv, spec, x2.shape[0], k)
    data = e4m3_round(y).to(torch.float8_e4m3fn).reshape(x.shape)
    return FP8Tensor(data=data, scale=scale, shape=x.shape, orig_dtype=x.dtype, spec=spec)


def fp8_dequantize(q: FP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``to_dtype(fl(float(e) * scale))`` with the scale broadcast over its block."""
    k = q.shape[-1]
    d = q.data.to(torch.float32).reshape(-1, k)
    out = (d * _expand_scale(q.scale, q.spec, d.shape[0], k)).reshape(q.shape)
    return out if dtype == torch.float32 else out.to(dtype)


def _register_tables() -> None:
    from qpass.tables import register

    @register("reference", FP8Spec)
    def _fp8_reference(spec: FP8Spec, x: torch.Tensor, *, amax: torch.Tensor | None = None,
                       site: str | None = None, name: str | None = None) -> FP8Tensor:
        """``fp8_quantize`` with the spec's granularity (scales from ``x``: ``amax`` is ignored)."""
        return fp8_quantize(x, spec=spec, site=site, name=name)


_register_tables()
