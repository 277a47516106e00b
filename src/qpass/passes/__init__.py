"""Built-in qpass passes (import name ``qpass.passes``). Importing this package registers them."""

from qpass.passes import act_qdq, fp32_accumulate, linear_lower, rac, weight_qdq  # noqa: F401

__all__ = ["act_qdq", "fp32_accumulate", "linear_lower", "rac", "weight_qdq"]
