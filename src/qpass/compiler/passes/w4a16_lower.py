"""``w4a16_lower`` (rollout): NVFP4 weights, activations in the model dtype (``w4a4_lower`` with
``act: none``; the generic lowering, :mod:`qpass.compiler.passes._lower`)."""

from __future__ import annotations

from qpass.compiler.manager import register_pass
from qpass.compiler.passes._lower import NVFP4Lower, NVFP4LowerOptions
from qpass.formats.spec import NVFP4ActMode


class W4A16LowerOptions(NVFP4LowerOptions):
    act: NVFP4ActMode = "none"


@register_pass
class W4A16Lower(NVFP4Lower):
    """NVFP4 weights, BF16 activations (``w4a4_lower`` with ``act: none``)."""

    name = "w4a16_lower"
    Options = W4A16LowerOptions
