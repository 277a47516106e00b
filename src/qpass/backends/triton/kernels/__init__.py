"""``@triton.jit`` kernels and their thin launchers (no semantics here: see the host wrappers).

Never import this package by its file name: ``qpass.backends.triton._loader.kernel_lib`` loads it
once per execution mode (compiled for CUDA tensors, interpreted for CPU tensors) under distinct
module names, because ``@triton.jit`` decides at import time whether it builds a GPU or an
interpreter function.
"""

from qpass.backends.triton.kernels import amax, common, fp8, mxfp4, nvfp4_gemm, nvfp4_quant, probe, rac  # noqa: F401
