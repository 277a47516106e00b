"""One spec, many lowerings: per-format tables, keyed by ``QuantSpec.key`` (JAX-style rule tables).

Every canonical spec in :data:`qpass.formats.spec.ALL_SPECS` must have an entry in every table; a
test asserts it, so a missing lowering is a failing test rather than a silent fallback.

* ``reference[key](x, amax=None, site=None) -> quantized tensor``: the plain-torch quantizer.
* ``learner_qdq[key](x, amax=None, site="") -> x_hat``: the learner's fake-quant custom op with STE
  (what ``weight_qdq`` / ``act_qdq`` insert).
* ``rollout_lower[key] -> RolloutLowering``: how the rollout graph carries the format: which op,
  which argument value, and (weights) how to build the graph constants from a weight.
* ``triton[key]``: the Triton quantize kernel, byte-identical to ``reference`` (registered by
  ``qpass.backends.triton`` on import).
* ``onnx_lower[key]``: the ONNX emitter (registered by ``qpass.backends.onnx`` on import).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from qpass.formats.spec import ALL_SPECS, FP8Spec, MXFP4Spec, NVFP4Spec, QuantSpec, spec_by_key

TABLES: dict[str, dict[str, Any]] = {"reference": {}, "learner_qdq": {}, "rollout_lower": {}, "triton": {}, "onnx_lower": {}}


def register(table: str, key: str) -> Callable[[Any], Any]:
    """Decorator: put ``obj`` in ``TABLES[table][key]`` (``key`` must be a canonical spec key)."""
    if table not in TABLES:
        raise KeyError(f"unknown lowering table {table!r}; tables: {list(TABLES)}")
    spec_by_key(key)

    def deco(obj: Any) -> Any:
        TABLES[table][key] = obj
        return obj

    return deco


def missing_entries() -> dict[str, list[str]]:
    """For each table, the canonical spec keys without an entry (loads the optional backends first)."""
    for mod in ("qpass.backends.triton", "qpass.backends.onnx"):
        try:
            __import__(mod)
        except ImportError:
            pass
    try:  # the Triton backend keeps its own spec -> kernel dict
        from qpass.backends.triton import TRITON_KERNELS

        for key, fn in TRITON_KERNELS.items():
            TABLES["triton"].setdefault(key, fn)
    except ImportError:
        pass
    return {t: [s.key for s in ALL_SPECS if s.key not in TABLES[t]] for t in TABLES}


# ------------------------------------------------------------------------------------------ reference
def _reference_quantize(spec: QuantSpec) -> Callable[..., Any]:
    from qpass.quant.fp8 import fp8_quantize
    from qpass.quant.mxfp4 import mxfp4_quantize
    from qpass.quant.nvfp4 import nvfp4_quantize

    if isinstance(spec, NVFP4Spec):
        return lambda x, amax=None, site=None: nvfp4_quantize(x, amax if spec.role == "weight" else None, spec=spec, site=site)
    if isinstance(spec, MXFP4Spec):
        return lambda x, amax=None, site=None: mxfp4_quantize(x, site=site)
    return lambda x, amax=None, site=None: fp8_quantize(x, spec=spec, site=site)


for _s in ALL_SPECS:
    TABLES["reference"][_s.key] = _reference_quantize(_s)


def reference_qdq(key: str, x: torch.Tensor, amax: torch.Tensor | None = None, site: str | None = None) -> torch.Tensor:
    """``dequantize(reference[key](x))`` in ``x.dtype``."""
    return TABLES["reference"][key](x, amax, site).dequantize(x.dtype)


# ------------------------------------------------------------------------------------------ learner
def _learner_entry(spec: QuantSpec) -> Callable[..., torch.Tensor]:
    from qpass.quant import qdq  # noqa: F401 - registers the ops

    if isinstance(spec, NVFP4Spec) and spec.role == "weight":
        def weight_qdq(x: torch.Tensor, amax: torch.Tensor | None = None, site: str = "") -> torch.Tensor:
            return torch.ops.qpass.nvfp4_qdq(x, amax if amax is not None else torch.ops.qpass.group_amax([x]), site)

        return weight_qdq
    if isinstance(spec, NVFP4Spec):
        per_token = spec.global_scope == "per_token"
        return lambda x, amax=None, site="": torch.ops.qpass.nvfp4_act_qdq(x, site, per_token)
    return lambda x, amax=None, site="": torch.ops.qpass.qdq(x, amax, spec.key, site)


for _s in ALL_SPECS:
    TABLES["learner_qdq"][_s.key] = _learner_entry(_s)


# ------------------------------------------------------------------------------------------ rollout
@dataclasses.dataclass(frozen=True)
class RolloutLowering:
    """How a rollout graph carries a spec.

    Attributes:
        op: the rollout custom op (``qpass::nvfp4_linear`` ...).
        arg: for activation specs, the op argument value selecting this format
            (``act='nvfp4_per_token'``, ``act_granularity='block_1x128'``); None for weights.
        constants: for weight specs, ``weight -> {name: tensor}`` (the graph constants); None for
            activations.
        lower_pass: the pass that produces it.
    """

    op: str
    arg: str | None
    constants: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None
    lower_pass: str


def _weight_constants(spec: QuantSpec) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    def build(w: torch.Tensor, amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        q = TABLES["reference"][spec.key](w, amax)
        if isinstance(spec, NVFP4Spec):
            return {"codes": q.codes, "scales": q.scales, "s_dec": q.s_dec, "s_enc": q.s_enc}
        if isinstance(spec, MXFP4Spec):
            return {"codes": q.codes, "scales": q.scales}
        return {"data": q.data, "scale": q.scale}

    return build


def _rollout_entry(spec: QuantSpec) -> RolloutLowering:
    if isinstance(spec, NVFP4Spec):
        if spec.role == "weight":
            return RolloutLowering("qpass::nvfp4_linear", None, _weight_constants(spec), "w4a4_lower")
        return RolloutLowering("qpass::nvfp4_linear", "nvfp4_per_token" if spec.global_scope == "per_token" else "nvfp4", None, "w4a4_lower")
    if isinstance(spec, MXFP4Spec):
        return RolloutLowering("qpass::mxfp4_linear", None, _weight_constants(spec), "mxfp4_lower")
    assert isinstance(spec, FP8Spec)
    if spec.role == "weight":
        return RolloutLowering("qpass::fp8_linear", None, _weight_constants(spec), "fp8_lower")
    return RolloutLowering("qpass::fp8_linear", spec.granularity.value, None, "fp8_lower")


for _s in ALL_SPECS:
    TABLES["rollout_lower"][_s.key] = _rollout_entry(_s)
