"""``@triton.jit`` kernels and their thin launchers (no semantics here: see the host wrappers).

Never import this package by its file name: ``qpass.backends.triton._loader.kernel_lib`` loads it
once per execution mode (compiled for CUDA tensors, interpreted for CPU tensors) under distinct
module names, because ``@triton.jit`` decides at import time whether it builds a GPU or an
interpreter function. For the same reason every import inside this package is *relative*: an
absolute ``qpass.backends.triton.kernels.X`` import would bind both copies to one module, built in
the mode of whichever copy was loaded first (the other mode's kernels then fail, e.g. the interpreter
copy calling compiled kernels raises "0 active drivers" on a machine without a GPU).
"""

from . import amax, common, fp8, mxfp4, nvfp4_gemm, nvfp4_gemv, nvfp4_grouped, nvfp4_quant, probe, rac  # noqa: F401
