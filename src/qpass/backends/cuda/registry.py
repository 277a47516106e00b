"""The ``cuda`` kernel backend's table entries (registered when this module is imported).

``use_kernels("cuda")`` runs ``qpass::nvfp4_linear`` on the NVRTC-compiled CUDA kernels wherever a
route takes the call (:mod:`qpass.backends.cuda.ops`), and on the Triton kernels otherwise; every
other op and the quantizers are the Triton backend's. Off CUDA the backend resolves to the
reference kernels (:func:`qpass.kernel_select.effective_backend`). The CUDA routes compute the same
SPEC §3.1 function as the Triton and reference kernels (same operands bit for bit, accumulation
within the SPEC bound); ``python -m qpass.apps.bench.cuda_check`` checks that on a GPU.
"""

from __future__ import annotations

import torch

import qpass.backends.triton.registry as triton_registry
from qpass.formats.spec import ALL_SPECS
from qpass.ops import FP8_LINEAR, NVFP4_LINEAR, FP8LinearCall, NVFP4LinearCall, register_kernel
from qpass.tables import QUANTIZE_OP, TABLES, kernel, register
from qpass.backends.cuda import ops as cuda_ops

BACKEND = "cuda"


@register_kernel(NVFP4_LINEAR, BACKEND)
def nvfp4_linear_cuda_op(call: NVFP4LinearCall) -> torch.Tensor:
    """``qpass::nvfp4_linear``: a CUDA route where one takes the call, the Triton kernel otherwise."""
    y = cuda_ops.nvfp4_linear(call)
    return y if y is not None else triton_registry.nvfp4_linear_triton_op(call)


@register_kernel(FP8_LINEAR, BACKEND)
def fp8_linear_cuda_op(call: FP8LinearCall) -> torch.Tensor:
    """``qpass::fp8_linear``: the Triton backend's kernel."""
    return triton_registry.fp8_linear_triton_op(call)


for _spec in ALL_SPECS:  # the quantizers are the Triton backend's (same bytes as the reference)
    if (QUANTIZE_OP, type(_spec), BACKEND) not in TABLES["kernels"]:
        register("kernels", type(_spec), op=QUANTIZE_OP, backend=BACKEND, claim=True)(kernel(QUANTIZE_OP, _spec, "triton"))
