"""``mxfp4_lower`` (rollout): ``aten.linear`` -> ``qpass.mxfp4_linear(x, codes, e8m0_scales, bias,
site)`` (W4A16 MXFP4, K % 32; the generic lowering, :mod:`qpass.compiler.passes._lower`)."""

from __future__ import annotations

from qpass.compiler.manager import PassOptions, register_pass
from qpass.compiler.passes._lower import LinearLower
from qpass.formats.spec import MXFP4_WEIGHT, QuantSpec


@register_pass
class MXFP4Lower(LinearLower):
    """Replace targeted linears by ``qpass.mxfp4_linear`` (W4A16 MXFP4)."""

    name = "mxfp4_lower"
    Options = PassOptions
    ensures = ("mxfp4_lowered",)

    def specs(self) -> tuple[QuantSpec, QuantSpec | None]:
        return MXFP4_WEIGHT, None
