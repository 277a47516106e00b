"""``w4a4_lower`` (rollout): NVFP4 weights and NVFP4 activations (``act``: an NVFP4 activation mode,
``act_scale``: dynamic | static).

Before / after (the generic lowering, :mod:`qpass.compiler.passes._lower`)::

    y = aten.linear(x, get_attr[model.layers.0.mlp.down_proj.weight])
 -> y = qpass.nvfp4_linear(x, codes, scales, s_dec, None, "model.layers.0.mlp.down_proj",
                           act="nvfp4", rac_ratio=0.0, rac_mode="masked", rac_selection="batch", None)
"""

from __future__ import annotations

from qpass.compiler.manager import register_pass
from qpass.compiler.passes._lower import NVFP4Lower, NVFP4LowerOptions


@register_pass
class W4A4Lower(NVFP4Lower):
    """NVFP4 weights + dynamically quantized NVFP4 activations (``act``: an NVFP4 activation mode)."""

    name = "w4a4_lower"
    Options = NVFP4LowerOptions
