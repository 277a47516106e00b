"""``onnx`` spec-table entries: one :class:`OnnxLowering` per canonical spec key.

Importing :mod:`qpass.backends.onnx` registers one entry per spec type in ``qpass.tables``
(``entry("onnx", spec)`` returns a ``spec -> OnnxLowering`` builder; use :func:`onnx_lowering`) and
claims every canonical spec, so the completeness test covers them.

* weight specs: ``entry(builder, q, name, dtype=...) -> value`` decodes a quantized weight ``q``
  (the object ``TABLES["reference"][key]`` returns) stored as initializers;
* activation specs: ``entry(builder, x, k, elem_type=..., dtype=...) -> value`` emits the dynamic
  fake-quant subgraph of input ``x`` ``[..., k]``;
* ``entry("onnx", spec).linear`` (:func:`onnx_linear`): the rollout linear op of a weight spec type
  (read a site from its op node or its checkpoint tensors, emit its GEMM operands), which the
  exports dispatch on.

``opset[flavour]`` is the lowest opset the emitted nodes need in that flavour.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

from qpass.formats.spec import ALL_SPECS, FP8Spec, MXFP4Spec, NVFP4Spec, QuantSpec
from qpass.tables import entry, register

from qpass.backends.onnx import emit
from qpass.backends.onnx.builder import PORTABLE_OPSET, GraphBuilder
from qpass.backends.onnx.linear import FP8_LINEAR, MXFP4_LINEAR, NVFP4_LINEAR, OnnxLinear


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


@dataclasses.dataclass(frozen=True)
class _OnnxRule:
    """``onnx`` table entry of a spec type: ``build(spec) -> OnnxLowering`` (the per-spec emitter)
    and ``linear`` (the rollout linear op of this weight spec type, :class:`~.linear.OnnxLinear`)."""

    build: Callable[[QuantSpec], OnnxLowering]
    linear: OnnxLinear

    def __call__(self, spec: QuantSpec) -> OnnxLowering:
        return self.build(spec)


_FP4 = {"spec": emit.OPSET_FP4, "portable": PORTABLE_OPSET}
# FP8 needs nothing newer than blocked DequantizeLinear (21); the spec flavour still says 23 so one
# spec-flavour model never mixes opsets below the FP4 ones.
_FP8 = {"spec": emit.OPSET_FP4, "portable": PORTABLE_OPSET}


def _nvfp4(spec: NVFP4Spec) -> OnnxLowering:
    if spec.role == "weight":
        return OnnxLowering(spec.key, "weight", _FP4, emit.nvfp4_weight)
    return OnnxLowering(spec.key, "activation", _FP4,
                        functools.partial(emit.nvfp4_activation, per_token=spec.global_scope == "per_token"))


def _fp8(spec: FP8Spec) -> OnnxLowering:
    if spec.role == "weight":
        return OnnxLowering(spec.key, "weight", _FP8, emit.fp8_weight)
    return OnnxLowering(spec.key, "activation", _FP8, functools.partial(emit.fp8_activation, spec=spec))


register("onnx", NVFP4Spec, claim=True)(_OnnxRule(_nvfp4, NVFP4_LINEAR))
register("onnx", MXFP4Spec, claim=True)(_OnnxRule(
    lambda spec: OnnxLowering(spec.key, "weight", {"spec": emit.OPSET_E8M0, "portable": PORTABLE_OPSET}, emit.mxfp4_weight),
    MXFP4_LINEAR))
register("onnx", FP8Spec, claim=True)(_OnnxRule(_fp8, FP8_LINEAR))


def onnx_lowering(spec: QuantSpec) -> OnnxLowering:
    """The ONNX emitter of ``spec`` (from the ``onnx`` spec table)."""
    return entry("onnx", spec)(spec)


def onnx_linear(spec: QuantSpec) -> OnnxLinear:
    """The ONNX lowering of weight spec ``spec``'s rollout linear op (from the ``onnx`` spec table).

    Raises:
        KeyError: no ``onnx`` entry for the spec's type (names the table and the spec).
    """
    return entry("onnx", spec).linear


ONNX_LOWERINGS: dict[str, OnnxLowering] = {s.key: onnx_lowering(s) for s in ALL_SPECS}
