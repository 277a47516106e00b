"""qpass's rollout custom ops: declared once (:mod:`.schema`), typed calls (:mod:`.calls`), the
linear ops with their reference kernels and ``rollout_lower`` entries (:mod:`.linear`), and the
kernel-backend selection.

Importing this package registers ``qpass::nvfp4_linear``, ``qpass::fp8_linear`` and
``qpass::mxfp4_linear``. Implementations live in the ``kernels`` spec table (:mod:`qpass.tables`)
keyed by ``(op, weight spec type, backend)``; every kernel receives the op's typed call object
(:class:`~qpass.ops.calls.NVFP4LinearCall` ...). Choose a backend with :func:`use_kernels` /
:func:`set_kernel_backend`; a backend without a kernel for an op is an error
(:class:`qpass.tables.KernelMissingError`), never a silent fallback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from qpass.errors import QpassError
from qpass.kernel_select import BACKEND, current_backend, effective_backend  # noqa: F401 (re-exported)
from qpass.ops.calls import FP8LinearCall, MXFP4LinearCall, NVFP4LinearCall  # noqa: F401 (re-exported)
from qpass.ops.linear import (  # noqa: F401 (re-exported)
    FP8_LINEAR,
    LINEAR_OPS,
    MXFP4_LINEAR,
    NVFP4_LINEAR,
    RolloutLowering,
    cached_weight,
    fp8_linear,
    mxfp4_linear,
    nvfp4_linear,
    serves_static_act,
    static_act_kernel_check,
)
from qpass.ops.schema import Arg, OpSchema, register_kernel  # noqa: F401 (re-exported)
from qpass.tables import TABLES


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
