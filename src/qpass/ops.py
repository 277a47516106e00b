"""Rollout-side custom ops and the kernel table they dispatch through.

Ops (namespace ``qpass``; each has a fake kernel so it survives ``torch.export``):

* ``qpass::nvfp4_linear(x, w_codes, w_scales, w_s_dec, bias?, site, act, rac_ratio, rac_mode,
  rac_selection, rac_channels?) -> Tensor``: the NVFP4 rollout linear. ``act='none'`` is W4A16,
  ``'nvfp4'`` W4A4 with a dynamic per-tensor activation global scale, ``'nvfp4_per_token'`` W4A4
  with one global scale per token. ``rac_ratio > 0`` adds residual activation compensation.
* ``qpass::fp8_linear(x, w_data, w_scale, bias?, site, act_granularity, w_granularity) -> Tensor``:
  W8A8 FP8 E4M3 with block (or per-tensor/per-token) scales.

Semantics: :mod:`qpass.quant.linear`. Implementations live in a kernel table keyed by
``(op, backend)``; ``reference`` (plain torch, CPU/CUDA) is always present and the Triton backend
registers itself on import. Choose with :func:`use_kernels` / :func:`set_kernel_backend`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from qpass.errors import QpassError
from qpass.formats.spec import FP8Spec, Granularity
from qpass.quant.fp8 import FP8Tensor
from qpass.quant.linear import fp8_linear_reference, w4a4_linear_reference, w4a16_linear_reference
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_act_spec, nvfp4_dequantize
from qpass.quant.rac import RACConfig

ACT_MODES = ("none", "nvfp4", "nvfp4_per_token")

_KERNELS: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}
_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("qpass_kernel_backend", default="reference")


def register_kernel(op: str, backend: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: register ``fn`` as the ``backend`` implementation of ``op``."""

    def deco(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        _KERNELS[(op, backend)] = fn
        return fn

    return deco


def kernel_backends(op: str) -> list[str]:
    """Backends that implement ``op``."""
    return sorted(b for (o, b) in _KERNELS if o == op)


def set_kernel_backend(name: str) -> None:
    """Select the kernel backend for subsequent calls in this context (``reference`` or ``triton``)."""
    if name == "triton":
        from qpass.backends import triton as _triton_backend  # noqa: F401  (registers its kernels)
    _BACKEND.set(name)


@contextlib.contextmanager
def use_kernels(name: str) -> Iterator[None]:
    """Context manager form of :func:`set_kernel_backend`."""
    if name == "triton":
        from qpass.backends import triton as _triton_backend  # noqa: F401
    token = _BACKEND.set(name)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def current_backend() -> str:
    return _BACKEND.get()


def effective_backend(name: str, device: str | torch.device) -> str:
    """The kernels that will actually run for backend ``name`` on ``device``: ``triton`` off CUDA
    runs the reference ops unless ``TRITON_INTERPRET=1`` (the same rule as the dispatcher)."""
    import os

    if name == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "reference"
    return name


_FALLBACK_WARNED: set[str] = set()


def _dispatch(op: str, device: torch.device) -> Callable[..., torch.Tensor]:
    backend = effective_backend(_BACKEND.get(), device)  # Triton kernels need a GPU or the interpreter
    fn = _KERNELS.get((op, backend))
    if fn is None and backend != "reference" and (op, "reference") in _KERNELS:
        if op not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(op)
            import logging

            logging.getLogger(__name__).warning("no %r kernel for %s: running the reference implementation", backend, op)
        fn = _KERNELS[(op, "reference")]
    if fn is None:
        raise QpassError(f"no {backend!r} kernel registered for {op}; available: {kernel_backends(op)}")
    return fn


# ---------------------------------------------------------------------------------------------
# Dequantized-weight cache for the reference backend: a weight buffer is decoded once per version.
# Keyed by storage addresses; an entry is valid only while it still refers to the *same* tensor
# objects (weak references) at the same in-place versions, so a freed-and-reused address or an
# in-place weight sync can never serve a stale decode.
_WHAT_CACHE: "OrderedDict[tuple[int, ...], tuple[tuple, tuple[int, ...], torch.Tensor]]" = OrderedDict()
_WHAT_CACHE_MAX = 512


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


@register_kernel("nvfp4_linear", "reference")
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
) -> torch.Tensor:
    w = NVFP4Tensor.from_parts(w_codes, w_scales, w_s_dec)
    # cached as float32 (exact: the decoded values are bf16) so each call skips the conversion
    w_hat = cached_weight((w_codes, w_scales, w_s_dec), lambda: nvfp4_dequantize(w, torch.bfloat16).float())
    if act == "none":
        return w4a16_linear_reference(x, w, bias, w_hat=w_hat, site=site)
    rac = RACConfig(rac_ratio, rac_mode, rac_selection) if rac_ratio > 0 else None
    return w4a4_linear_reference(
        x, w, bias, act_spec=nvfp4_act_spec(act == "nvfp4_per_token"), rac=rac,
        static_channels=rac_channels, w_hat=w_hat, site=site,
    )


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
) -> torch.Tensor:
    """NVFP4 rollout linear ``x [..., K] -> [..., N]`` (see module docstring)."""
    if act not in ACT_MODES:
        raise QpassError(f"nvfp4_linear at site {site}: act must be one of {ACT_MODES}, got {act!r}")
    fn = _dispatch("nvfp4_linear", x.device)
    return fn(x, w_codes, w_scales, w_s_dec, bias, site, act, rac_ratio, rac_mode, rac_selection, rac_channels)


@nvfp4_linear.register_fake
def _nvfp4_linear_fake(x, w_codes, w_scales, w_s_dec, bias, site, act, rac_ratio, rac_mode, rac_selection, rac_channels):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], w_codes.shape[0]))


@register_kernel("mxfp4_linear", "reference")
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
    return _dispatch("mxfp4_linear", x.device)(x, w_codes, w_scales, bias, site)


@mxfp4_linear.register_fake
def _mxfp4_linear_fake(x, w_codes, w_scales, bias, site):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], w_codes.shape[0]))


def _fp8_spec(granularity: str, role: str) -> FP8Spec:
    return FP8Spec(role=role, granularity=Granularity(granularity))


@register_kernel("fp8_linear", "reference")
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
    fn = _dispatch("fp8_linear", x.device)
    return fn(x, w_data, w_scale, bias, site, act_granularity, w_granularity)


@fp8_linear.register_fake
def _fp8_linear_fake(x, w_data, w_scale, bias, site, act_granularity, w_granularity):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], w_data.shape[0]))
