"""Deprecated package path, kept for one release: the built-in passes live in
:mod:`qpass.compiler.passes` (one module per recipe word). Importing this package registers them
(once: every ``qpass.passes.<old name>`` module is the very module object of its new home).

Old name -> new module: ``act_qdq``, ``weight_qdq`` (same names); ``rac`` ->
``residual_compensation``; ``fp32_accumulate`` -> ``fp32_accumulate_linear``; ``linear_lower`` ->
``_lower`` plus ``w4a4_lower`` / ``w4a16_lower`` / ``fp8_lower`` / ``mxfp4_lower``; ``common`` -> ``_common``.
"""

import qpass.compiler.passes  # noqa: F401 - registers the built-in passes
from qpass.passes import act_qdq, fp32_accumulate, linear_lower, rac, weight_qdq  # noqa: F401

__all__ = ["act_qdq", "fp32_accumulate", "linear_lower", "rac", "weight_qdq"]
