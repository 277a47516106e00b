"""Built-in qpass passes, one module per recipe word (import name ``qpass.compiler.passes``).

Importing this package registers them. Shared helpers live in the underscored modules
(``_common``: target selection and node surgery; ``_lower``: the generic linear lowering).
"""

from qpass.compiler.passes import act_qdq, fp32_accumulate_linear, residual_compensation, weight_qdq  # noqa: F401
from qpass.compiler.passes import _lower  # noqa: F401

__all__ = ["act_qdq", "fp32_accumulate_linear", "residual_compensation", "weight_qdq"]
