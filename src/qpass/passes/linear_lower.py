"""Deprecated import path, kept for one release: the lowering passes now live one per recipe word
in :mod:`qpass.compiler.passes` (``w4a4_lower``, ``w4a16_lower``, ``fp8_lower``, ``mxfp4_lower``),
their shared body in :mod:`qpass.compiler.passes._lower`. The names below are the very same objects
(tests/test_import_map.py forbids new src uses of this path)."""

from qpass.compiler.passes._lower import LinearLower, NVFP4Lower, NVFP4LowerOptions, constant_name
from qpass.compiler.passes.fp8_lower import FP8Lower, FP8LowerOptions
from qpass.compiler.passes.mxfp4_lower import MXFP4Lower
from qpass.compiler.passes.w4a4_lower import W4A4Lower
from qpass.compiler.passes.w4a16_lower import W4A16Lower, W4A16LowerOptions

_NVFP4Lower = NVFP4Lower  # the former private name

__all__ = ["FP8Lower", "FP8LowerOptions", "LinearLower", "MXFP4Lower", "NVFP4Lower", "NVFP4LowerOptions",
           "W4A16Lower", "W4A16LowerOptions", "W4A4Lower", "constant_name"]
