"""MXFP4 reference quantizer (OCP Microscaling Formats v1.0, §6.3 conversion).

Per block of 32 along K: ``e = floor(log2(vmax)) - 2`` (2 = emax of E2M1), clamped to the E8M0
range ``[-127, 127]`` (an all-zero block gets ``-127``); scale byte ``e + 127``; element
``e2m1_rne(clamp(x * 2^-e, -6, 6))``. ``floor(log2 v)`` is read from the float32 exponent
(``frexp``), so it is exact at powers of two where ``log2`` from libm may be off.
"""

from __future__ import annotations

import dataclasses

import torch

from qpass.formats.e2m1 import e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1
from qpass.formats.e8m0 import E8M0_BIAS, e8m0_to_float
from qpass.formats.spec import MXFP4_WEIGHT, MXFP4Spec
from qpass.quant.checks import check_float_input

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class MXFP4Tensor:
    """codes uint8 ``[..., K/2]`` (low nibble = even k); scales uint8 E8M0 ``[..., K/32]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    orig_dtype: torch.dtype
    spec: MXFP4Spec = MXFP4_WEIGHT

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return mxfp4_dequantize(self, dtype)


def mxfp4_quantize(x: torch.Tensor, *, name: str | None = None, site: str | None = None) -> MXFP4Tensor:
    """Quantize to MXFP4.

    Args:
        x: bf16/fp16/fp32, shape ``(..., K)``, ``K % 32 == 0``, finite.
    Returns:
        :class:`MXFP4Tensor`.
    Raises:
        QuantizationError: as :func:`qpass.quant.checks.check_float_input` with multiple_of=32.
    """
    check_float_input(x, op="mxfp4_quantize", multiple_of=BLOCK, name=name, site=site)
    lead, k = x.shape[:-1], x.shape[-1]
    xb = x.float().reshape(*lead, k // BLOCK, BLOCK)
    vmax = xb.abs().amax(dim=-1)
    _, exp = torch.frexp(vmax)  # vmax = m * 2^exp, m in [0.5, 1): floor(log2 vmax) = exp - 1
    e = torch.where(vmax > 0, exp.to(torch.int32) - 1 - 2, torch.full_like(exp, -E8M0_BIAS, dtype=torch.int32))
    e = torch.clamp(e, -E8M0_BIAS, E8M0_BIAS)
    inv = torch.ldexp(torch.ones_like(vmax), -e)
    y = torch.clamp(xb * inv.unsqueeze(-1), -6.0, 6.0)
    codes = e2m1_encode(y).reshape(*lead, k)
    return MXFP4Tensor(
        codes=pack_e2m1(codes), scales=(e + E8M0_BIAS).to(torch.uint8), shape=x.shape, orig_dtype=x.dtype
    )


def mxfp4_dequantize(q: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``to_dtype(e2m1(q) * 2^(scale-127))`` (the product is exact in float32)."""
    vals = e2m1_decode(unpack_e2m1(q.codes))
    lead, k = vals.shape[:-1], vals.shape[-1]
    s = e8m0_to_float(q.scales).unsqueeze(-1)
    out = (vals.reshape(*lead, k // BLOCK, BLOCK) * s).reshape(*lead, k)
    return out if dtype == torch.float32 else out.to(dtype)


def _register_tables() -> None:
    from qpass.tables import register

    @register("reference", MXFP4Spec)
    def _mxfp4_reference(spec: MXFP4Spec, x: torch.Tensor, *, amax: torch.Tensor | None = None,
                         site: str | None = None, name: str | None = None) -> MXFP4Tensor:
        """``mxfp4_quantize`` (no global scale: ``amax`` is ignored)."""
        return mxfp4_quantize(x, site=site, name=name)


_register_tables()
