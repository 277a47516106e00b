"""A small ONNX graph builder: unique names, cached scalar constants, raw-byte initializers.

The emitters in :mod:`qpass.backends.onnx.emit` write nodes through :class:`GraphBuilder`; it
keeps them short and makes every constant an exact float32 (or typed) initializer, so no value is
ever rounded implicitly by a runtime. Quantized initializers are built from qpass's stored bytes
(``raw_data``), so the bytes inside an exported ``.onnx`` are the checkpoint's bytes:

* FLOAT4E2M1 ``[N, K]``: the packed ``uint8 [N, K/2]`` codes as they are (ONNX packs two 4-bit
  values per byte, element ``2j`` in the low nibble: the same order as qpass and ModelOpt).
* FLOAT8E4M3FN / FLOAT8E8M0: one byte per element, copied.

Source of the type and packing rules: ONNX IR spec (``TensorProto.FLOAT4E2M1 = 23``, 4-bit types
are packed low nibble first) and ``prior-art/backends.md`` §5.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

FLT_MAX = float(np.finfo(np.float32).max)

TORCH_TO_ONNX = {
    torch.float32: TensorProto.FLOAT,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float16: TensorProto.FLOAT16,
    torch.uint8: TensorProto.UINT8,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN,
}

# Opset per flavour: ``spec`` uses the ONNX FP4/FP8 types natively (FLOAT4E2M1 needs
# DequantizeLinear-23, FLOAT8E8M0 scales need 24); ``portable`` stays at opset 21 with only the
# operators onnxruntime's CPU provider implements (uint8 nibbles, LUT Gather, fp8 DequantizeLinear).
FLAVOURS = ("spec", "portable")
PORTABLE_OPSET = 21


def check_flavour(flavour: str) -> None:
    if flavour not in FLAVOURS:
        raise ValueError(f"ONNX flavour must be one of {FLAVOURS}, got {flavour!r}")


class GraphBuilder:
    """Accumulates nodes, initializers and graph I/O; :meth:`model` makes the ``ModelProto``.

    Args:
        flavour: ``spec`` or ``portable`` (what emitters may use, see module docstring).
        name: graph name.
    """

    def __init__(self, flavour: str, name: str = "qpass") -> None:
        check_flavour(flavour)
        self.flavour = flavour
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.opset = PORTABLE_OPSET
        self._names: set[str] = set()
        self._consts: dict[tuple[Any, ...], str] = {}
        self._counter = itertools.count()

    # ------------------------------------------------------------------ names
    def fresh(self, hint: str) -> str:
        """A value name not used before (``hint``, ``hint_1``, ...)."""
        name = hint
        while name in self._names:
            name = f"{hint}_{next(self._counter)}"
        self._names.add(name)
        return name

    def need_opset(self, opset: int) -> None:
        """Raise the model opset to at least ``opset``."""
        self.opset = max(self.opset, opset)

    # ------------------------------------------------------------------ nodes
    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, **attrs: Any) -> str:
        """Append one node with a single output; returns the output name."""
        out = self.fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self.fresh("n_" + out), **attrs))
        return out

    # ------------------------------------------------------------------ constants
    def f32(self, value: float) -> str:
        """Scalar float32 initializer holding ``fl(value)`` (cached by bit pattern)."""
        v = np.float32(value)
        key = ("f32", struct.pack("<f", v))
        if key not in self._consts:
            self._consts[key] = self.initializer(np.array(v, dtype=np.float32), f"c_f32_{len(self._consts)}")
        return self._consts[key]

    def i64(self, values: Sequence[int] | int) -> str:
        """int64 initializer: a scalar for an ``int``, a 1-D tensor for a sequence (cached)."""
        arr = np.array(values, dtype=np.int64)
        key = ("i64", arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer(arr, f"c_i64_{len(self._consts)}")
        return self._consts[key]

    def u8(self, value: int) -> str:
        """Scalar uint8 initializer (cached)."""
        key = ("u8", int(value))
        if key not in self._consts:
            self._consts[key] = self.initializer(np.array(value, dtype=np.uint8), f"c_u8_{len(self._consts)}")
        return self._consts[key]

    def table(self, values: Sequence[float], hint: str) -> str:
        """float32 1-D lookup table initializer (cached by content)."""
        arr = np.asarray(values, dtype=np.float32)
        key = ("tab", arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer(arr, hint)
        return self._consts[key]

    def initializer(self, array: np.ndarray, hint: str) -> str:
        """Add a numpy array as an initializer; returns its name."""
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def raw(self, data: torch.Tensor, onnx_type: int, dims: Sequence[int], hint: str) -> str:
        """Initializer of ``onnx_type`` whose ``raw_data`` is the bytes of ``data`` (copied, never converted).

        Args:
            data: any contiguous tensor; its bytes become the payload (e.g. packed uint8 codes for
                FLOAT4E2M1 ``dims=[N, K]``, uint8 bytes for FLOAT8E8M0).
            onnx_type: ``TensorProto`` element type.
            dims: logical ONNX shape.
        """
        name = self.fresh(hint)
        b = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        self.initializers.append(helper.make_tensor(name, onnx_type, list(dims), b, raw=True))
        return name

    def torch_initializer(self, t: torch.Tensor, hint: str) -> str:
        """Initializer holding ``t`` exactly (float32/bf16/fp16/uint8/int/fp8 dtypes)."""
        if t.dtype not in TORCH_TO_ONNX:
            raise TypeError(f"no ONNX element type for {t.dtype} (initializer {hint})")
        return self.raw(t, TORCH_TO_ONNX[t.dtype], list(t.shape), hint)

    # ------------------------------------------------------------------ I/O and model
    def add_input(self, name: str, elem_type: int, shape: Sequence[int | str | None]) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def add_output(self, value: str, name: str, elem_type: int, shape: Sequence[int | str | None]) -> str:
        """Expose ``value`` as graph output ``name`` (an Identity node renames it)."""
        if value != name:
            self._names.add(name)
            self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh("n_out_" + name)))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def model(self, *, doc: str = "") -> onnx.ModelProto:
        """The ``ModelProto``: default domain at ``self.opset``, the lowest IR version for it
        (10 for opset 21, 11 for 23 (FLOAT4E2M1), 12 for 24 (FLOAT8E8M0)), so older runtimes accept
        the portable flavour."""
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers, doc_string=doc)
        opsets = [helper.make_opsetid("", self.opset)]
        m = helper.make_model(graph, opset_imports=opsets, producer_name="qpass")
        m.ir_version = helper.find_min_ir_version_for(opsets)
        return m
