"""Built-in qpass passes, one module per recipe word (import name ``qpass.compiler.passes``).

Importing this package registers them. Shared helpers live in the underscored modules
(``_common``: target selection and node surgery; ``_lower``: the generic linear lowering the four
``*_lower`` passes configure).
"""

from qpass.compiler.passes import (  # noqa: F401
    act_qdq,
    fp8_lower,
    fp32_accumulate_linear,
    mxfp4_lower,
    residual_compensation,
    w4a4_lower,
    w4a16_lower,
    weight_qdq,
)

#: the recipe words, one module each
__all__ = ["act_qdq", "fp32_accumulate_linear", "fp8_lower", "mxfp4_lower", "residual_compensation",
           "w4a16_lower", "w4a4_lower", "weight_qdq"]
