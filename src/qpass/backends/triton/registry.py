"""The Triton backend's spec-table entries (registered when this module is imported).

* ``kernels``: ``(qpass::nvfp4_linear, NVFP4Spec, "triton")`` and ``(qpass::fp8_linear, FP8Spec,
  "triton")``. There is no Triton ``qpass::mxfp4_linear``: a recipe that lowers to it with the
  Triton backend is rejected at validation (:func:`qpass.tables.check_kernels`).
* ``kernels`` op ``quantize`` (:data:`qpass.tables.QUANTIZE_OP`), one per spec type:
  ``fn(spec, x, **reference options)`` returns the same tensor type as the ``reference`` table entry,
  byte for byte. ``TRITON_KERNELS`` (spec key -> quantizer of that spec) is a view of these entries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qpass.formats.spec import ALL_SPECS, FP8Spec, Granularity, MXFP4Spec, NVFP4Spec
from qpass.ops import register_kernel
from qpass.tables import QUANTIZE_OP, kernel, register
from qpass.quant.nvfp4 import nvfp4_act_spec
from qpass.quant.rac import RACConfig
from qpass.backends.triton.linear import fp8_linear_triton, w4a4_linear_triton, w4a16_linear_triton
from qpass.backends.triton.quantize import fp8_quantize_triton, mxfp4_quantize_triton, nvfp4_quantize_triton


@register("kernels", NVFP4Spec, op=QUANTIZE_OP, backend="triton", claim=True)
def _nvfp4_quantize(spec: NVFP4Spec, x: torch.Tensor, *args: object, **kw: object) -> object:
    return nvfp4_quantize_triton(x, *args, per_token=spec.global_scope == "per_token", spec=spec, **kw)


@register("kernels", MXFP4Spec, op=QUANTIZE_OP, backend="triton", claim=True)
def _mxfp4_quantize(spec: MXFP4Spec, x: torch.Tensor, *args: object, **kw: object) -> object:
    return mxfp4_quantize_triton(x, *args, **kw)


@register("kernels", FP8Spec, op=QUANTIZE_OP, backend="triton", claim=True)
def _fp8_quantize(spec: FP8Spec, x: torch.Tensor, *args: object, **kw: object) -> object:
    return fp8_quantize_triton(x, *args, spec=spec, **kw)


TRITON_KERNELS: dict[str, Callable[..., object]] = {
    spec.key: functools.partial(kernel(QUANTIZE_OP, spec, "triton"), spec) for spec in ALL_SPECS
}


@register_kernel("qpass::nvfp4_linear", "triton", NVFP4Spec)
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


@register_kernel("qpass::fp8_linear", "triton", FP8Spec)
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
