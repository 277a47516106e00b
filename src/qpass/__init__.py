"""qpass: compiler passes for low-precision (NVFP4, FP8) RL rollouts, with a bit-exact parity checker.

Public quantizer API (stable names)::

    q = qpass.nvfp4_quantize(x, amax=None, group=None, process_group=None)
    q.codes   # uint8 [R, K/2], low nibble = even k
    q.scales  # torch.float8_e4m3fn [R, K/16], linear layout
    q.s_dec   # float32 decode global scale (multiplier)
    w_hat = qpass.nvfp4_dequantize(q, dtype=torch.bfloat16)
    f = qpass.fp8_quantize(x, granularity="block_1x128")
"""

from qpass.errors import (
    CaptureError,
    NoMatchError,
    ParityError,
    PassError,
    PostconditionError,
    PreconditionError,
    QpassError,
    QuantizationError,
    RecipeError,
)
from qpass.formats.spec import FP8Spec, MXFP4Spec, NVFP4Spec
from qpass.quant.fp8 import FP8Tensor, fp8_dequantize, fp8_quantize
from qpass.quant.mxfp4 import MXFP4Tensor, mxfp4_dequantize, mxfp4_quantize
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_dequantize, nvfp4_quantize
from qpass.quant.qdq import nvfp4_qdq

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "FP8Spec",
    "FP8Tensor",
    "MXFP4Spec",
    "MXFP4Tensor",
    "NVFP4Spec",
    "NVFP4Tensor",
    "NoMatchError",
    "ParityError",
    "PassError",
    "PostconditionError",
    "PreconditionError",
    "QpassError",
    "QuantizationError",
    "RecipeError",
    "fp8_dequantize",
    "fp8_quantize",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_qdq",
    "nvfp4_quantize",
]
