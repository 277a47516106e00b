"""``fp8_lower`` (rollout): ``aten.linear`` -> ``qpass.fp8_linear(x, w_fp8, w_scale, bias, site,
act_granularity, w_granularity)`` (W8A8 FP8 E4M3, DeepSeek-style blocks by default; the generic
lowering, :mod:`qpass.compiler.passes._lower`)."""

from __future__ import annotations

from typing import Literal

from qpass.compiler.manager import PassOptions, register_pass
from qpass.compiler.passes._lower import LinearLower
from qpass.formats.spec import FP8Spec, Granularity, QuantSpec


class FP8LowerOptions(PassOptions):
    act_granularity: Literal["block_1x128", "per_token", "per_tensor"] = "block_1x128"
    weight_granularity: Literal["block_128x128", "per_tensor"] = "block_128x128"


@register_pass
class FP8Lower(LinearLower):
    """Replace targeted linears by ``qpass.fp8_linear`` (W8A8 FP8 E4M3)."""

    name = "fp8_lower"
    Options = FP8LowerOptions
    ensures = ("fp8_lowered",)

    def specs(self) -> tuple[QuantSpec, QuantSpec | None]:
        o = self.options
        return (FP8Spec(role="weight", granularity=Granularity(o.weight_granularity)),
                FP8Spec(role="activation", granularity=Granularity(o.act_granularity)))
