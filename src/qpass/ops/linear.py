"""The rollout linear ops, declared once: schemas, reference kernels, ``rollout_lower`` entries.

Ops (namespace ``qpass``; each survives ``torch.export`` as one node with its fake kernel):

* ``qpass::nvfp4_linear(x, w_codes, w_scales, w_s_dec, bias?, site, act, rac_ratio, rac_mode,
  rac_selection, rac_channels?, act_amax?=None)``: the NVFP4 rollout linear; kernels receive a
  :class:`~qpass.ops.calls.NVFP4LinearCall` (``act='none'`` W4A16, ``'nvfp4'`` / ``'nvfp4_per_token'``
  W4A4 with a dynamic global scale, ``'nvfp4_static'`` W4A4 with the calibrated per-tensor amax
  ``act_amax`` (float32 0-d; ``qpass calibrate``), ``rac_ratio > 0`` residual activation
  compensation). Only kernels marked :func:`serves_static_act` (the reference one) take
  ``'nvfp4_static'``; another backend is a :class:`~qpass.tables.KernelMissingError` naming the site
  (:func:`static_act_kernel_check`, also run when a rollout graph is built), never a silently dynamic
  scale. Inside :func:`qpass.quant.observe.observe_input_amax` every call records its input amax.
* ``qpass::fp8_linear(x, w_data, w_scale, bias?, site, act_granularity, w_granularity)``: W8A8 FP8
  E4M3 (:class:`~qpass.ops.calls.FP8LinearCall`).
* ``qpass::mxfp4_linear(x, w_codes, w_scales, bias?, site)``: MXFP4 weight-only
  (:class:`~qpass.ops.calls.MXFP4LinearCall`).

Semantics: :mod:`qpass.quant.linear`. The ``reference`` kernels (plain torch, CPU/CUDA) are
registered here; other backends register theirs with :func:`qpass.ops.schema.register_kernel` when
their module is imported (core never imports a backend).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from qpass.formats.spec import NVFP4_WEIGHT, FP8Spec, MXFP4Spec, NVFP4Spec, QuantSpec
from qpass.ops.calls import FP8LinearCall, MXFP4LinearCall, NVFP4LinearCall
from qpass.ops.schema import Arg, OpSchema, register_kernel
from qpass.quant.fp8 import fp8_dequantize
from qpass.quant.linear import fp8_linear_reference, mxfp4_linear_reference, nvfp4_linear_reference
from qpass.quant.mxfp4 import mxfp4_dequantize
from qpass.quant.nvfp4 import nvfp4_operand
from qpass.quant.observe import record as observe_input
from qpass.tables import KernelMissingError, kernel, register

# A kernel of qpass::nvfp4_linear that implements the static (calibrated) activation scale carries this
# attribute set to True (serves_static_act); kernels written before static scales existed lack it.
STATIC_ACT_ATTR = "qpass_serves_static_act"


def serves_static_act(fn: Callable[..., torch.Tensor]) -> bool:
    """Whether a ``qpass::nvfp4_linear`` kernel implements ``act='nvfp4_static'`` (reads ``call.act_amax``)."""
    return bool(getattr(fn, STATIC_ACT_ATTR, False))


def static_act_kernel_check(backend: str, site: str) -> None:
    """Refuse a static activation scale on a backend whose ``qpass::nvfp4_linear`` kernel has none.

    Raises:
        KernelMissingError: names the site and the backend (also when the backend has no kernel at all).
    """
    if not serves_static_act(kernel("qpass::nvfp4_linear", NVFP4_WEIGHT, backend)):
        raise KernelMissingError(
            f"site {site}: the {backend!r} kernel of qpass::nvfp4_linear has no static (calibrated) activation scale "
            "(act: nvfp4_static); use --kernels reference, or act_scale: dynamic")


def _nvfp4_before_kernel(call: NVFP4LinearCall, fn: Callable[..., torch.Tensor], backend: str) -> None:
    observe_input(call.site, call.x)
    if call.static_act and not serves_static_act(fn):
        static_act_kernel_check(backend, call.site)


NVFP4_LINEAR = OpSchema(
    "qpass::nvfp4_linear",
    (Arg("x", "Tensor"), Arg("w_codes", "Tensor"), Arg("w_scales", "Tensor"), Arg("w_s_dec", "Tensor"),
     Arg("bias", "Tensor?"), Arg("site", "str"), Arg("act", "str"), Arg("rac_ratio", "float"), Arg("rac_mode", "str"),
     Arg("rac_selection", "str"), Arg("rac_channels", "Tensor?"), Arg("act_amax", "Tensor?", None)),
    call=NVFP4LinearCall, spec_type=NVFP4Spec, out_features="w_codes",
    doc="NVFP4 rollout linear x [..., K] -> [..., N] (qpass.ops.calls.NVFP4LinearCall).",
    before_kernel=_nvfp4_before_kernel,
)
FP8_LINEAR = OpSchema(
    "qpass::fp8_linear",
    (Arg("x", "Tensor"), Arg("w_data", "Tensor"), Arg("w_scale", "Tensor"), Arg("bias", "Tensor?"), Arg("site", "str"),
     Arg("act_granularity", "str"), Arg("w_granularity", "str")),
    call=FP8LinearCall, spec_type=FP8Spec, out_features="w_data",
    doc="FP8 E4M3 W8A8 rollout linear x [..., K] -> [..., N] (qpass.ops.calls.FP8LinearCall).",
)
MXFP4_LINEAR = OpSchema(
    "qpass::mxfp4_linear",
    (Arg("x", "Tensor"), Arg("w_codes", "Tensor"), Arg("w_scales", "Tensor"), Arg("bias", "Tensor?"), Arg("site", "str")),
    call=MXFP4LinearCall, spec_type=MXFP4Spec, out_features="w_codes",
    doc="MXFP4 weight-only rollout linear x [..., K] -> [..., N] (qpass.ops.calls.MXFP4LinearCall).",
)
LINEAR_OPS: tuple[OpSchema, ...] = (NVFP4_LINEAR, FP8_LINEAR, MXFP4_LINEAR)

nvfp4_linear = NVFP4_LINEAR.define()
fp8_linear = FP8_LINEAR.define()
mxfp4_linear = MXFP4_LINEAR.define()


# ---------------------------------------------------------------------------------------------
# Decoded-operand cache for the reference backend: a weight buffer is decoded once per version.
# Keyed by storage addresses; an entry is valid only while it still refers to the *same* tensor
# objects (weak references) at the same in-place versions, so a freed-and-reused address or an
# in-place weight sync can never serve a stale decode.
_WHAT_CACHE: "OrderedDict[tuple[int, ...], tuple[tuple, tuple[int, ...], torch.Tensor]]" = OrderedDict()
# Must hold every lowered site of a model, else each decode step re-decodes every weight (LRU thrash):
# the upcycled MoE default has 840 sites (720 experts).
_WHAT_CACHE_MAX = 1024


def cached_weight(parts: tuple[torch.Tensor, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Memoise ``make()`` (a decoded weight) on the identity and in-place version of ``parts``."""
    import weakref

    key = tuple(t.data_ptr() for t in parts)
    versions = tuple(t._version for t in parts)
    hit = _WHAT_CACHE.get(key)
    if hit is not None:
        refs, vers, val = hit
        if vers == versions and all(r() is t for r, t in zip(refs, parts)):
            _WHAT_CACHE.move_to_end(key)
            return val
    val = make()
    _WHAT_CACHE[key] = (tuple(weakref.ref(t) for t in parts), versions, val)
    _WHAT_CACHE.move_to_end(key)
    if len(_WHAT_CACHE) > _WHAT_CACHE_MAX:
        _WHAT_CACHE.popitem(last=False)
    return val


def forget_weight(*parts: torch.Tensor) -> None:
    """Drop every cached decode whose key starts with the storages of ``parts`` (in order).

    An engine's weight loader may write a served buffer through ``param.data`` (a view with its own
    version counter), which :func:`cached_weight` cannot see: the serving layer calls this after each
    load (:func:`qpass.checkpoint.linear.finish_loading`)."""
    head = tuple(t.data_ptr() for t in parts)
    for key in [k for k in _WHAT_CACHE if k[: len(head)] == head]:
        del _WHAT_CACHE[key]


@register_kernel(NVFP4_LINEAR, "reference")
def nvfp4_linear_ref(call: NVFP4LinearCall) -> torch.Tensor:
    """Reference kernel of ``qpass::nvfp4_linear`` (``B_W`` cached per weight version, float32: exact);
    serves every activation mode, the static one included."""
    w = call.weight
    return nvfp4_linear_reference(call, b_w=cached_weight((w.codes, w.scales), lambda: nvfp4_operand(w)))


setattr(nvfp4_linear_ref, STATIC_ACT_ATTR, True)


@register_kernel(MXFP4_LINEAR, "reference")
def mxfp4_linear_ref(call: MXFP4LinearCall) -> torch.Tensor:
    """Reference kernel of ``qpass::mxfp4_linear``."""
    w = call.weight
    return mxfp4_linear_reference(call, w_hat=cached_weight((w.codes, w.scales), lambda: mxfp4_dequantize(w, torch.bfloat16)))


@register_kernel(FP8_LINEAR, "reference")
def fp8_linear_ref(call: FP8LinearCall) -> torch.Tensor:
    """Reference kernel of ``qpass::fp8_linear``."""
    w = call.weight
    return fp8_linear_reference(call, w_deq=cached_weight((w.data, w.scale), lambda: fp8_dequantize(w, torch.float32)))


# ---------------------------------------------------------------------------------------------
# ``rollout_lower`` entries: how a linear whose weight has spec S becomes one of the ops above.
@dataclasses.dataclass(frozen=True)
class RolloutLowering:
    """How the rollout graph carries a weight spec type.

    Attributes:
        schema: the rollout op (:class:`~qpass.ops.schema.OpSchema`); its call class gives the option
            arguments of a lowered site (``schema.call.lowering_args(weight spec, act spec, site)``).
        lower_pass: the recipe pass that emits it by default.
        k_multiple: in_features must be a multiple of this (the block size along K).
        constants: ``quantized weight -> {name: tensor}``: the graph constants of one site, in order.
        constant_args: constant name -> op argument it feeds, in op order; constants not listed
            are kept as buffers only (NVFP4 ``s_enc``: exported, never read by the op).
        served_format: ``qpass.runtime.served.ServedSite.format`` of such a site (its tensors are
            the ``constant_args`` constants, in order).
    """

    schema: OpSchema
    lower_pass: str
    k_multiple: int
    constants: Callable[[Any], dict[str, torch.Tensor]]
    constant_args: Mapping[str, str]
    served_format: str

    @property
    def op(self) -> str:
        """``qpass::<op>``."""
        return self.schema.name

    def op_overload(self) -> Any:
        """``torch.ops.qpass.<name>.default``."""
        return self.schema.overload()

    def option_args(self, weight: QuantSpec, act: QuantSpec | None, site: str = "") -> dict[str, Any]:
        """The op's non-tensor arguments (and ``None`` tensor options) of a freshly lowered site.

        Raises:
            QpassError: the op cannot carry ``act`` (names the site).
        """
        return self.schema.call.lowering_args(weight, act, site)


register("rollout_lower", NVFP4Spec, claim=True)(RolloutLowering(
    NVFP4_LINEAR, lower_pass="w4a4_lower", k_multiple=16,
    constants=lambda q: {"codes": q.codes, "scales": q.scales, "s_dec": q.s_dec, "s_enc": q.s_enc},
    constant_args={"codes": "w_codes", "scales": "w_scales", "s_dec": "w_s_dec"}, served_format="nvfp4",
))
register("rollout_lower", MXFP4Spec, claim=True)(RolloutLowering(
    MXFP4_LINEAR, lower_pass="mxfp4_lower", k_multiple=32,
    constants=lambda q: {"codes": q.codes, "scales": q.scales},
    constant_args={"codes": "w_codes", "scales": "w_scales"}, served_format="mxfp4",
))
register("rollout_lower", FP8Spec, claim=True)(RolloutLowering(
    FP8_LINEAR, lower_pass="fp8_lower", k_multiple=1,
    constants=lambda q: {"data": q.data, "scale": q.scale},
    constant_args={"data": "w_data", "scale": "w_scale"}, served_format="fp8",
))
