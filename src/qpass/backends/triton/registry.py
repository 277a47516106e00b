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

from qpass.formats.spec import ALL_SPECS, FP8Spec, MXFP4Spec, NVFP4Spec
from qpass.ops import FP8_LINEAR, NVFP4_LINEAR, FP8LinearCall, NVFP4LinearCall, register_kernel
from qpass.tables import QUANTIZE_OP, kernel, register
from qpass.backends.triton.linear import fp8_linear_triton_call, nvfp4_linear_triton
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


@register_kernel(NVFP4_LINEAR, "triton")
def nvfp4_linear_triton_op(call: NVFP4LinearCall) -> torch.Tensor:
    """``qpass::nvfp4_linear`` on the Triton kernels (:func:`~qpass.backends.triton.linear.nvfp4_linear_triton`)."""
    return nvfp4_linear_triton(call)


@register_kernel(FP8_LINEAR, "triton")
def fp8_linear_triton_op(call: FP8LinearCall) -> torch.Tensor:
    """``qpass::fp8_linear`` on the Triton backend (``torch._scaled_mm`` where its layout allows)."""
    return fp8_linear_triton_call(call)
