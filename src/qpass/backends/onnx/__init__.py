"""ONNX backend: ``onnx`` spec-table emitters for every canonical spec and rollout export.

Importing this package registers the ``onnx`` entries (one per spec type: an
:class:`~qpass.backends.onnx.table.OnnxLowering` per spec, and for weight spec types the
:class:`~qpass.backends.onnx.linear.OnnxLinear` of their rollout linear op, which the exports
dispatch on) in :mod:`qpass.tables`. Two flavours of graph:

* ``spec`` (opset 23, 24 with MXFP4): FLOAT4E2M1 / FLOAT8E4M3FN / FLOAT8E8M0 initializers and
  DequantizeLinear; validated with ``onnx.checker.check_model(full_check=True)`` and run by
  ``onnx.reference.ReferenceEvaluator``.
* ``portable`` (opset 21): uint8 nibbles + LUT Gather + fp8 DequantizeLinear/Cast, which
  onnxruntime's CPU provider executes.

Both reproduce qpass's reference arithmetic bit for bit (:mod:`.emit`). Needs the ``onnx`` extra
(``onnx``, ``ml_dtypes``); ``onnxruntime`` only to run portable graphs.

Exports: :func:`export_rollout_onnx` (every quantized linear of a rollout as its own subgraph;
from a rollout graph or a ``qpass apply`` directory) and :func:`export_rollout_graph_onnx` (the
whole rollout-lowered scoring graph through ``torch.onnx.export(dynamo=True)``; needs onnxscript).
"""

from qpass.backends.onnx.builder import FLAVOURS, GraphBuilder
from qpass.backends.onnx.export import export_rollout_onnx, rollout_sites_model
from qpass.backends.onnx.graph_export import export_rollout_graph_onnx, rollout_graph_model, rollout_scoring_graph
from qpass.backends.onnx.runtime import activation_qdq_model, run_onnx, weight_decode_model
from qpass.backends.onnx.linear import OnnxLinear, SiteLinear
from qpass.backends.onnx.table import ONNX_LOWERINGS, OnnxLowering, onnx_linear, onnx_lowering

__all__ = [
    "FLAVOURS",
    "GraphBuilder",
    "ONNX_LOWERINGS",
    "OnnxLinear",
    "OnnxLowering",
    "SiteLinear",
    "activation_qdq_model",
    "export_rollout_graph_onnx",
    "export_rollout_onnx",
    "onnx_linear",
    "onnx_lowering",
    "rollout_graph_model",
    "rollout_scoring_graph",
    "rollout_sites_model",
    "run_onnx",
    "weight_decode_model",
]
