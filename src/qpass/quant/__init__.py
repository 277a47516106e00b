"""Reference quantizers (plain torch, CPU or CUDA): NVFP4, MXFP4, FP8, groups, layouts, QDQ ops."""

from qpass.quant.fp8 import FP8Tensor, fp8_dequantize, fp8_quantize
from qpass.quant.groups import group_amax, tensor_amax
from qpass.quant.mxfp4 import MXFP4Tensor, mxfp4_dequantize, mxfp4_quantize
from qpass.quant.nvfp4 import NVFP4Tensor, global_scales, nvfp4_dequantize, nvfp4_quantize

__all__ = [
    "FP8Tensor",
    "MXFP4Tensor",
    "NVFP4Tensor",
    "fp8_dequantize",
    "fp8_quantize",
    "global_scales",
    "group_amax",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "tensor_amax",
]
