"""Triton kernels for Hopper (sm_90): NVFP4 / FP8 / MXFP4 quantization, fused RAC, W4A16 / W4A4 /
FP8 linears.

Importing this package registers ``nvfp4_linear`` and ``fp8_linear`` under backend ``"triton"`` in
``qpass.ops``' kernel table (``qpass.ops.use_kernels("triton")`` imports it). It imports cleanly
without a GPU: kernels compile lazily on first use; CUDA tensors run compiled, CPU tensors run
under the Triton interpreter (slow; tests and ``qpass bench --quick``).

Public API:
    nvfp4_quantize_triton(x, amax=None, per_token=False) -> NVFP4Tensor   (bit-identical to reference)
    fp8_quantize_triton(x, granularity) -> FP8Tensor, mxfp4_quantize_triton(x) -> MXFP4Tensor
    rac_triton(x, cfg, act_spec, static_channels=None) -> RACResult        (bit-identical to reference)
    nvfp4_linear_triton(call) / fp8_linear_triton_call(call): the op kernels (typed calls, qpass.ops.calls)
    w4a16_linear_triton / w4a4_linear_triton / fp8_linear_triton: keyword conveniences that build the call
    TRITON_KERNELS: spec key -> quantizer;  no_sync_checks(): context for sync-free decode loops
"""

from __future__ import annotations

from qpass.errors import MissingDependencyError

INSTALL_HINT = 'pip install -e ".[triton]"  (from a qpass checkout; or pip install "qpass[triton]")'

try:
    import triton  # noqa: F401
except ImportError as exc:
    raise MissingDependencyError(
        f"qpass.backends.triton (qpass bench, --kernels triton) needs the 'triton' package (triton==3.6.0), "
        f"which is not installed: {INSTALL_HINT}"
    ) from exc

from qpass.backends.triton._config import no_sync_checks, sync_checks_enabled
from qpass.backends.triton.linear import (
    fp8_linear_triton,
    fp8_linear_triton_call,
    nvfp4_linear_triton,
    w4a4_linear_triton,
    w4a16_linear_triton,
)
from qpass.backends.triton.quantize import fp8_quantize_triton, mxfp4_quantize_triton, nvfp4_quantize_triton
from qpass.backends.triton.rac import rac_run, rac_triton
from qpass.backends.triton.registry import TRITON_KERNELS, fp8_linear_triton_op, nvfp4_linear_triton_op

__all__ = [
    "TRITON_KERNELS",
    "fp8_linear_triton",
    "fp8_linear_triton_call",
    "fp8_linear_triton_op",
    "fp8_quantize_triton",
    "mxfp4_quantize_triton",
    "no_sync_checks",
    "nvfp4_linear_triton",
    "nvfp4_linear_triton_op",
    "nvfp4_quantize_triton",
    "rac_run",
    "rac_triton",
    "sync_checks_enabled",
    "w4a4_linear_triton",
    "w4a16_linear_triton",
]
