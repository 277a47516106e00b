"""Rollout-side custom ops, their reference kernels and their ``rollout_lower`` table entries.

Ops (namespace ``qpass``; each has a fake kernel so it survives ``torch.export``):

* ``qpass::nvfp4_linear(x, w_codes, w_scales, w_s_dec, bias?, site, act, rac_ratio, rac_mode,
  rac_selection, rac_channels?, act_amax?=None) -> Tensor``: the NVFP4 rollout linear. ``act='none'``
  is W4A16, ``'nvfp4'`` W4A4 with a dynamic per-tensor activation global scale,
  ``'nvfp4_per_token'`` W4A4 with one global scale per token, ``'nvfp4_static'`` W4A4 with the
  calibrated per-tensor amax ``act_amax`` (float32 0-d; ``qpass calibrate``). ``rac_ratio > 0`` adds
  residual activation compensation. Only kernels that take an ``act_amax`` argument implement
  ``'nvfp4_static'`` (the reference one); another backend is a :class:`KernelMissingError`
  (:func:`static_act_kernel_check`), never a silently dynamic scale. Inside
  :func:`qpass.quant.observe.observe_input_amax` every call records its input amax.
* ``qpass::fp8_linear(x, w_data, w_scale, bias?, site, act_granularity, w_granularity) -> Tensor``:
  W8A8 FP8 E4M3 with block (or per-tensor/per-token) scales.
* ``qpass::mxfp4_linear(x, w_codes, w_scales, bias?, site) -> Tensor``: MXFP4 weight-only.

Semantics: :mod:`qpass.quant.linear`. Implementations live in the ``kernels`` spec table
(:mod:`qpass.tables`) keyed by ``(op, weight spec type, backend)``; ``reference`` (plain torch,
CPU/CUDA) is registered here, other backends register when their module is imported (core never
imports a backend). Choose with :func:`use_kernels` / :func:`set_kernel_backend`; a backend without a
kernel for an op is an error (:class:`qpass.tables.KernelMissingError`), never a silent fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from qpass.errors import QpassError
from qpass.formats.spec import FP8Spec, Granularity, MXFP4_WEIGHT, MXFP4Spec, NVFP4_WEIGHT, NVFP4Spec, QuantSpec
from qpass.kernel_select import BACKEND, current_backend, effective_backend  # noqa: F401 (re-exported)
from qpass.quant.fp8 import FP8Tensor
from qpass.quant.linear import fp8_linear_reference, w4a4_linear_reference, w4a16_linear_reference
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_act_spec, nvfp4_dequantize
from qpass.quant.observe import record as _observe
from qpass.quant.rac import RACConfig
from qpass.tables import TABLES, KernelMissingError, kernel, register

ACT_MODES = ("none", "nvfp4", "nvfp4_per_token", "nvfp4_static")
# The rollout NVFP4/MXFP4 ops multiply weights decoded to this dtype (SPEC §3 dequant: bf16_rne),
# whatever the model dtype; the parity checker compares the learner's operand against it.
WEIGHT_OPERAND_DTYPE = torch.bfloat16



def register_kernel(op: str, backend: str, spec_type: type = NVFP4Spec) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: register ``fn`` as the ``backend`` kernel of ``op`` (``qpass::name`` or ``name``)
    for weight specs of ``spec_type`` (shorthand for ``tables.register("kernels", ...)``)."""
    full = op if "::" in op else f"qpass::{op}"
    return register("kernels", spec_type, op=full, backend=backend, claim=True)


def kernel_backends(op: str) -> list[str]:
    """Backends that implement ``op`` (``qpass::name`` or ``name``)."""
    from qpass.tables import kernel_backends as kb

    return kb(op if "::" in op else f"qpass::{op}")


def registered_backends() -> list[str]:
    """Kernel backends with at least one registered kernel."""
    return sorted({b for (_, _, b) in TABLES["kernels"]})


def _require_registered(name: str) -> None:
    if name not in registered_backends():
        raise QpassError(
            f"kernel backend {name!r} has no registered kernels (registered: {registered_backends()}); "
            f"its module registers them when imported (e.g. import qpass.backends.{name})"
        )


def set_kernel_backend(name: str) -> None:
    """Select the kernel backend for subsequent calls in this context.

    Raises:
        QpassError: ``name`` has no registered kernels (import its backend module first).
    """
    _require_registered(name)
    BACKEND.set(name)


@contextlib.contextmanager
def use_kernels(name: str) -> Iterator[None]:
    """Context manager form of :func:`set_kernel_backend`."""
    _require_registered(name)
    token = BACKEND.set(name)
    try:
        yield
    finally:
        BACKEND.reset(token)


def _dispatch(op: str, spec: QuantSpec, device: torch.device) -> Callable[..., torch.Tensor]:
    """The kernel of ``op`` for ``spec`` on the current backend (Triton needs a GPU or the interpreter).

    Raises:
        KernelMissingError: the backend has no kernel for this op/spec (no silent fallback).
    """
    return kernel(op, spec, effective_backend(BACKEND.get(), device))


# ---------------------------------------------------------------------------------------------
# Dequantized-weight cache for the reference backend: a weight buffer is decoded once per version.
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


@register_kernel("qpass::nvfp4_linear", "reference", NVFP4Spec)
def _nvfp4_linear_ref(
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
    act_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    w = NVFP4Tensor.from_parts(w_codes, w_scales, w_s_dec)
    # cached as float32 (exact: the decoded values are bf16) so each call skips the conversion
    w_hat = cached_weight((w_codes, w_scales, w_s_dec), lambda: nvfp4_dequantize(w, WEIGHT_OPERAND_DTYPE).float())
    if act == "none":
        return w4a16_linear_reference(x, w, bias, w_hat=w_hat, site=site)
    rac = RACConfig(rac_ratio, rac_mode, rac_selection) if rac_ratio > 0 else None
    return w4a4_linear_reference(
        x, w, bias, act_spec=nvfp4_act_spec(act == "nvfp4_per_token", act == "nvfp4_static"), rac=rac,
        static_channels=rac_channels, act_amax=act_amax, w_hat=w_hat, site=site,
    )


def supports_static_act(fn: Callable[..., torch.Tensor]) -> bool:
    """Whether an ``qpass::nvfp4_linear`` kernel implements ``act='nvfp4_static'`` (it takes ``act_amax``)."""
    import inspect

    try:
        return "act_amax" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def static_act_kernel_check(backend: str, site: str) -> None:
    """Refuse a static activation scale on a backend whose ``qpass::nvfp4_linear`` kernel has none.

    Raises:
        KernelMissingError: names the site and the backend.
    """
    fn = kernel("qpass::nvfp4_linear", NVFP4_WEIGHT, backend)
    if not supports_static_act(fn):
        raise KernelMissingError(
            f"site {site}: the {backend!r} kernel of qpass::nvfp4_linear has no static (calibrated) activation scale "
            "(act: nvfp4_static); use --kernels reference, or act_scale: dynamic")


@torch.library.custom_op("qpass::nvfp4_linear", mutates_args=())
def nvfp4_linear(
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
    act_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 rollout linear ``x [..., K] -> [..., N]`` (see module docstring).

    An input without rows (an MoE expert no token was routed to in this batch) gives an empty
    output without quantizing anything (there is no amax to take).
    """
    if act not in ACT_MODES:
        raise QpassError(f"nvfp4_linear at site {site}: act must be one of {ACT_MODES}, got {act!r}")
    if (act == "nvfp4_static") != (act_amax is not None):
        raise QpassError(f"nvfp4_linear at site {site}: act {act!r} with act_amax {'given' if act_amax is not None else 'None'} "
                         "(a calibrated act_amax goes with act='nvfp4_static' only)")
    if x.numel() == 0:
        return x.new_zeros((*x.shape[:-1], w_codes.shape[0]))
    _observe(site, x)
    backend = effective_backend(BACKEND.get(), x.device)
    fn = kernel("qpass::nvfp4_linear", NVFP4_WEIGHT, backend)
    args = (x, w_codes, w_scales, w_s_dec, bias, site, act, rac_ratio, rac_mode, rac_selection, rac_channels)
    if act_amax is None:
        return fn(*args)
    if not supports_static_act(fn):
        static_act_kernel_check(backend, site)
    return fn(*args, act_amax=act_amax)


@nvfp4_linear.register_fake
def _nvfp4_linear_fake(x, w_codes, w_scales, w_s_dec, bias, site, act, rac_ratio, rac_mode, rac_selection, rac_channels,  # noqa: ANN001
                       act_amax=None):
    return x.new_empty((*x.shape[:-1], w_codes.shape[0]))


@register_kernel("qpass::mxfp4_linear", "reference", MXFP4Spec)
def _mxfp4_linear_ref(x, w_codes, w_scales, bias, site):  # noqa: ANN001
    from qpass.quant.mxfp4 import MXFP4Tensor, mxfp4_dequantize

    w = MXFP4Tensor(codes=w_codes, scales=w_scales, shape=torch.Size((w_codes.shape[0], w_codes.shape[1] * 2)), orig_dtype=torch.bfloat16)
    w_hat = cached_weight((w_codes, w_scales), lambda: mxfp4_dequantize(w, torch.bfloat16))
    if x.shape[-1] != w_hat.shape[1]:
        from qpass.errors import QuantizationError

        raise QuantizationError(f"input has K={x.shape[-1]} but the weight has K={w_hat.shape[1]} at site {site}")
    acc = x.reshape(-1, x.shape[-1]).float() @ w_hat.float().t()
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*x.shape[:-1], acc.shape[-1]).to(x.dtype)


@torch.library.custom_op("qpass::mxfp4_linear", mutates_args=())
def mxfp4_linear(x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None, site: str) -> torch.Tensor:
    """MXFP4 weight-only rollout linear ``x [..., K] -> [..., N]`` (E2M1 codes, E8M0 scale per 32)."""
    return _dispatch("qpass::mxfp4_linear", MXFP4_WEIGHT, x.device)(x, w_codes, w_scales, bias, site)


@mxfp4_linear.register_fake
def _mxfp4_linear_fake(x, w_codes, w_scales, bias, site):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], w_codes.shape[0]))


def _fp8_spec(granularity: str, role: str) -> FP8Spec:
    return FP8Spec(role=role, granularity=Granularity(granularity))


@register_kernel("qpass::fp8_linear", "reference", FP8Spec)
def _fp8_linear_ref(x, w_data, w_scale, bias, site, act_granularity, w_granularity):  # noqa: ANN001
    w = FP8Tensor(data=w_data, scale=w_scale, shape=w_data.shape, orig_dtype=torch.bfloat16, spec=_fp8_spec(w_granularity, "weight"))
    from qpass.quant.fp8 import fp8_dequantize

    w_deq = cached_weight((w_data, w_scale), lambda: fp8_dequantize(w, torch.float32))
    return fp8_linear_reference(x, w, bias, act_spec=_fp8_spec(act_granularity, "activation"), w_deq=w_deq, site=site)


@torch.library.custom_op("qpass::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    site: str,
    act_granularity: str,
    w_granularity: str,
) -> torch.Tensor:
    """FP8 E4M3 W8A8 rollout linear ``x [..., K] -> [..., N]``."""
    fn = _dispatch("qpass::fp8_linear", _fp8_spec(w_granularity, "weight"), x.device)
    return fn(x, w_data, w_scale, bias, site, act_granularity, w_granularity)


@fp8_linear.register_fake
def _fp8_linear_fake(x, w_data, w_scale, bias, site, act_granularity, w_granularity):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], w_data.shape[0]))


# ---------------------------------------------------------------------------------------------
# ``rollout_lower`` entries: how a linear whose weight has spec S becomes one of the ops above.
@dataclasses.dataclass(frozen=True)
class RolloutLowering:
    """How the rollout graph carries a weight spec type (and the activation specs of the same op).

    Attributes:
        op: the rollout op (``qpass::nvfp4_linear`` ...).
        lower_pass: the recipe pass that emits it by default.
        k_multiple: in_features must be a multiple of this (the block size along K).
        constants: ``quantized weight -> {name: tensor}``: the graph constants of one site, in order.
        constant_args: constant name -> op argument it feeds; constants not listed are kept as
            buffers only (NVFP4 ``s_enc``: exported, never read by the op).
        weight_args: ``weight spec -> {op argument: value}`` (e.g. FP8 ``w_granularity``).
        act_arg: the op argument that selects the activation format (None: weight-only op).
        act_value: ``activation spec -> act_arg value``.
        no_act: value of ``act_arg`` when activations stay unquantized (None: an activation spec
            is required).
        defaults: values of the remaining non-tensor arguments (RAC off).
    """

    op: str
    lower_pass: str
    k_multiple: int
    constants: Callable[[Any], dict[str, torch.Tensor]]
    constant_args: Mapping[str, str]
    weight_args: Callable[[QuantSpec], dict[str, Any]] = lambda spec: {}
    act_arg: str | None = None
    act_value: Callable[[QuantSpec], str] | None = None
    no_act: str | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def op_overload(self) -> Any:
        """``torch.ops.qpass.<name>.default``."""
        ns, name = self.op.split("::")
        return getattr(getattr(torch.ops, ns), name).default

    def act_setting(self, act_spec: QuantSpec | None, site: str = "") -> dict[str, Any]:
        """``{act_arg: value}`` for an activation spec (or none).

        Raises:
            QpassError: the op cannot carry ``act_spec`` (names the site).
        """
        if self.act_arg is None:
            if act_spec is not None:
                raise QpassError(f"site {site}: {self.op} is weight-only; it cannot quantize activations as {act_spec.key}")
            return {}
        if act_spec is None:
            if self.no_act is None:
                raise QpassError(f"site {site}: {self.op} needs an activation spec")
            return {self.act_arg: self.no_act}
        return {self.act_arg: self.act_value(act_spec)}


register("rollout_lower", NVFP4Spec, claim=True)(RolloutLowering(
    op="qpass::nvfp4_linear", lower_pass="w4a4_lower", k_multiple=16,
    constants=lambda q: {"codes": q.codes, "scales": q.scales, "s_dec": q.s_dec, "s_enc": q.s_enc},
    constant_args={"codes": "w_codes", "scales": "w_scales", "s_dec": "w_s_dec"},
    act_arg="act", act_value=lambda a: ("nvfp4_per_token" if a.global_scope == "per_token" else
                                        "nvfp4_static" if a.global_source == "static" else "nvfp4"), no_act="none",
    defaults={"rac_ratio": 0.0, "rac_mode": "masked", "rac_selection": "batch", "rac_channels": None},
))
register("rollout_lower", MXFP4Spec, claim=True)(RolloutLowering(
    op="qpass::mxfp4_linear", lower_pass="mxfp4_lower", k_multiple=32,
    constants=lambda q: {"codes": q.codes, "scales": q.scales},
    constant_args={"codes": "w_codes", "scales": "w_scales"},
))
register("rollout_lower", FP8Spec, claim=True)(RolloutLowering(
    op="qpass::fp8_linear", lower_pass="fp8_lower", k_multiple=1,
    constants=lambda q: {"data": q.data, "scale": q.scale},
    constant_args={"data": "w_data", "scale": "w_scale"},
    weight_args=lambda w: {"w_granularity": w.granularity.value},
    act_arg="act_granularity", act_value=lambda a: a.granularity.value,
))
