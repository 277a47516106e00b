"""The Triton backend's tables: quantize kernel per format spec, and the ``qpass.ops`` kernels.

``TRITON_KERNELS`` maps every spec key of ``qpass.formats.spec.ALL_SPECS`` (``nvfp4.weight.per_tensor``,
``fp8_e4m3.activation.block_1x128``, ...) to the Triton quantizer for that spec; each entry takes
the tensor (plus the reference quantizer's keyword options) and returns the same tensor type as the
reference quantizer, byte for byte.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qpass.formats.spec import ALL_SPECS, FP8Spec, Granularity, MXFP4Spec, NVFP4Spec
from qpass.ops import register_kernel
from qpass.quant.nvfp4 import nvfp4_act_spec
from qpass.quant.rac import RACConfig
from qpass.backends.triton.linear import fp8_linear_triton, w4a4_linear_triton, w4a16_linear_triton
from qpass.backends.triton.quantize import fp8_quantize_triton, mxfp4_quantize_triton, nvfp4_quantize_triton


def _quantizer_for(spec) -> Callable[..., object]:
    if isinstance(spec, NVFP4Spec):
        return functools.partial(nvfp4_quantize_triton, per_token=spec.global_scope == "per_token", spec=spec)
    if isinstance(spec, MXFP4Spec):
        return mxfp4_quantize_triton
    if isinstance(spec, FP8Spec):
        return functools.partial(fp8_quantize_triton, spec=spec)
    raise TypeError(f"no Triton quantizer for spec {spec!r}")


TRITON_KERNELS: dict[str, Callable[..., object]] = {spec.key: _quantizer_for(spec) for spec in ALL_SPECS}


@register_kernel("nvfp4_linear", "triton")
def nvfp4_linear_triton(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_s_dec: torch.Tensor,
    bias: torch.Tensor | None,
    site: str,
    act: str,
    rac_ratio: float,
    rac_mode: str,
    rac_selection: str,
    rac_channels: torch.Tensor | None,
) -> torch.Tensor:
    """``qpass::nvfp4_linear`` on the Triton kernels: ``act='none'`` -> W4A16, else W4A4 (+RAC)."""
    if act == "none":
        return w4a16_linear_triton(x, w_codes, w_scales, w_s_dec, bias, site=site)
    rac = RACConfig(rac_ratio, rac_mode, rac_selection) if rac_ratio > 0 else None
    return w4a4_linear_triton(
        x, w_codes, w_scales, w_s_dec, bias, act_spec=nvfp4_act_spec(act == "nvfp4_per_token"), rac=rac,
        static_channels=rac_channels, site=site,
    )


@register_kernel("fp8_linear", "triton")
def fp8_linear_triton_op(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    site: str,
    act_granularity: str,
    w_granularity: str,
) -> torch.Tensor:
    """``qpass::fp8_linear`` on the Triton backend (``torch._scaled_mm`` where its layout allows)."""
    return fp8_linear_triton(
        x, w_data, w_scale, bias,
        act_spec=FP8Spec(role="activation", granularity=Granularity(act_granularity)),
        w_spec=FP8Spec(role="weight", granularity=Granularity(w_granularity)),
        site=site,
    )
