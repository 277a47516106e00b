"""``onnx_lower`` entries: one :class:`OnnxLowering` per canonical spec key (JAX-style rule table).

Importing :mod:`qpass.backends.onnx` registers them in ``qpass.lowering.TABLES["onnx_lower"]``.

* weight specs: ``entry(builder, q, name, dtype=...) -> value`` decodes a quantized weight ``q``
  (the object ``TABLES["reference"][key]`` returns) stored as initializers;
* activation specs: ``entry(builder, x, k, elem_type=..., dtype=...) -> value`` emits the dynamic
  fake-quant subgraph of input ``x`` ``[..., k]``.

``opset[flavour]`` is the lowest opset the emitted nodes need in that flavour.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

from qpass.formats.spec import ALL_SPECS, FP8Spec, MXFP4Spec, NVFP4Spec, QuantSpec
from qpass.lowering import register

from qpass.backends.onnx import emit
from qpass.backends.onnx.builder import PORTABLE_OPSET, GraphBuilder


@dataclasses.dataclass(frozen=True)
class OnnxLowering:
    """The ONNX emitter of one spec.

    Attributes:
        key: canonical spec key (``nvfp4.weight.per_tensor`` ...).
        role: ``weight`` (decoder of stored bytes) or ``activation`` (dynamic fake-quant).
        opset: lowest opset per flavour (``spec``: 23 for FP4 types, 24 with E8M0 scales;
            ``portable``: 21).
        fn: the emitter (see module docstring for the call signatures).
    """

    key: str
    role: Literal["weight", "activation"]
    opset: Mapping[str, int]
    fn: Callable[..., str]

    def __call__(self, b: GraphBuilder, *args: Any, **kwargs: Any) -> str:
        b.need_opset(self.opset[b.flavour])
        return self.fn(b, *args, **kwargs)


def _entry(spec: QuantSpec) -> OnnxLowering:
    portable = PORTABLE_OPSET
    if isinstance(spec, NVFP4Spec):
        if spec.role == "weight":
            return OnnxLowering(spec.key, "weight", {"spec": emit.OPSET_FP4, "portable": portable}, emit.nvfp4_weight)
        fn = functools.partial(emit.nvfp4_activation, per_token=spec.global_scope == "per_token")
        return OnnxLowering(spec.key, "activation", {"spec": emit.OPSET_FP4, "portable": portable}, fn)
    if isinstance(spec, MXFP4Spec):
        return OnnxLowering(spec.key, "weight", {"spec": emit.OPSET_E8M0, "portable": portable}, emit.mxfp4_weight)
    assert isinstance(spec, FP8Spec)
    # FP8 needs nothing newer than blocked DequantizeLinear (21); the spec flavour still says 23
    # so one spec-flavour model never mixes opsets below the FP4 ones.
    opset = {"spec": emit.OPSET_FP4, "portable": portable}
    if spec.role == "weight":
        return OnnxLowering(spec.key, "weight", opset, emit.fp8_weight)
    return OnnxLowering(spec.key, "activation", opset, functools.partial(emit.fp8_activation, spec=spec))


ONNX_LOWERINGS: dict[str, OnnxLowering] = {}
for _spec in ALL_SPECS:
    ONNX_LOWERINGS[_spec.key] = register("onnx_lower", _spec.key)(_entry(_spec))
