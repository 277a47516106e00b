"""Standalone ONNX models for one spec, and running ONNX models on torch tensors.

* :func:`weight_decode_model`: no inputs, one output ``w_hat`` = the decoded weight.
* :func:`activation_qdq_model`: input ``x``, output ``x_hat`` = the dynamic fake-quant.
* :func:`run_onnx`: run a model with ``onnx.reference.ReferenceEvaluator`` (every flavour; the
  ONNX reference semantics) or ``onnxruntime`` (CPU provider; portable flavour only: onnxruntime
  1.30/1.32 implement neither FLOAT4E2M1 DequantizeLinear nor Cast, prior-art/backends.md §5).

bf16 tensors cross the numpy boundary as ``ml_dtypes.bfloat16`` (bit for bit). onnxruntime's
Python API has no bf16 numpy type, so models meant for it use float32 inputs and outputs (a bf16
value is exact in float32; rounding to bf16 happens inside the graph).
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto

from qpass.formats.spec import spec_by_key

from qpass.backends.onnx.builder import TORCH_TO_ONNX, GraphBuilder, check_flavour
from qpass.backends.onnx.table import onnx_lowering

RUNTIMES = ("reference", "onnxruntime")


def default_io_dtype(flavour: str, dtype: torch.dtype) -> torch.dtype:
    """Graph I/O element type: ``dtype`` for spec graphs, float32 for portable ones (onnxruntime)."""
    return dtype if flavour == "spec" else torch.float32


def _io_cast(b: GraphBuilder, value: str, dtype: torch.dtype, io_dtype: torch.dtype) -> str:
    """Cast a ``dtype`` value to the I/O type (bf16 -> float32 is exact)."""
    return value if io_dtype == dtype else b.op("Cast", [value], "io_cast", to=TORCH_TO_ONNX[io_dtype])


def weight_decode_model(
    key: str, q: object, *, flavour: str = "spec", dtype: torch.dtype = torch.bfloat16, io_dtype: torch.dtype | None = None,
    name: str = "w", **kw: object,
) -> onnx.ModelProto:
    """A model whose output ``w_hat`` is the decode of quantized weight ``q``, rounded to ``dtype``.

    Args:
        key: a weight spec key; ``q`` is what ``TABLES["reference"][key]`` returned.
        dtype: the decode's rounding (``q.dequantize(dtype)``); float32 = exact decode.
        io_dtype: element type of the graph output (default: :func:`default_io_dtype`).
        kw: extra emitter options (``pattern='double_dq'`` for NVFP4).
    """
    check_flavour(flavour)
    entry = onnx_lowering(spec_by_key(key))
    if entry.role != "weight":
        raise ValueError(f"{key} is an activation spec; use activation_qdq_model")
    io_dtype = io_dtype or default_io_dtype(flavour, dtype)
    b = GraphBuilder(flavour, name=f"decode_{key}")
    out = _io_cast(b, entry(b, q, name, dtype=TORCH_TO_ONNX[dtype], **kw), dtype, io_dtype)
    b.add_output(out, "w_hat", TORCH_TO_ONNX[io_dtype], list(q.shape))
    return b.model(doc=f"qpass {key} weight decode ({flavour})")


def activation_qdq_model(
    key: str, shape: tuple[int | str, ...], *, flavour: str = "spec", dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None, io_dtype: torch.dtype | None = None,
) -> onnx.ModelProto:
    """A model ``x -> x_hat`` for activation spec ``key``; ``x`` has ``shape`` (the last dim static).

    Args:
        dtype: the activation's dtype (the graph computes on ``x.to(dtype)``, exactly like qpass
            on a tensor of that dtype).
        out_dtype: rounding of ``x_hat`` (default ``dtype``: what ``reference_qdq`` returns;
            bf16 is what the rollout linear feeds its GEMM).
        io_dtype: element type of the graph input and output (default: :func:`default_io_dtype`);
            a bf16 activation fed as float32 is exact.
    """
    check_flavour(flavour)
    spec_by_key(key)
    entry = onnx_lowering(spec_by_key(key))
    if entry.role != "activation":
        raise ValueError(f"{key} is a weight spec; use weight_decode_model")
    out_dtype = out_dtype or dtype
    io_dtype = io_dtype or default_io_dtype(flavour, dtype)
    b = GraphBuilder(flavour, name=f"qdq_{key}")
    x = b.add_input("x", TORCH_TO_ONNX[io_dtype], list(shape))
    if io_dtype != dtype:
        x = b.op("Cast", [x], "x_in", to=TORCH_TO_ONNX[dtype])
    out = entry(b, x, int(shape[-1]), elem_type=TORCH_TO_ONNX[dtype], dtype=TORCH_TO_ONNX[out_dtype])
    b.add_output(_io_cast(b, out, out_dtype, io_dtype), "x_hat", TORCH_TO_ONNX[io_dtype], list(shape))
    return b.model(doc=f"qpass {key} dynamic fake-quant ({flavour})")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Tensor -> numpy, bit for bit (bf16 as ``ml_dtypes.bfloat16``, fp8 as ``ml_dtypes.float8_e4m3fn``)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """numpy -> tensor, bit for bit (inverse of :func:`to_numpy`)."""
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def run_onnx(model: onnx.ModelProto, feeds: Mapping[str, torch.Tensor], *, runtime: str = "reference", threads: int = 1) -> dict[str, torch.Tensor]:
    """Run ``model`` on torch tensors; returns ``{output name: tensor}``.

    Args:
        runtime: ``reference`` (``onnx.reference.ReferenceEvaluator``) or ``onnxruntime`` (CPU
            execution provider, default graph optimizations, ``threads`` intra-op threads).
    Raises:
        ValueError: unknown runtime; ImportError: onnxruntime not installed; TypeError: bf16
            input or output with onnxruntime (use float32 I/O).
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    np_feeds = {k: to_numpy(v) for k, v in feeds.items()}
    if runtime == "reference":
        from onnx.reference import ReferenceEvaluator

        outs = ReferenceEvaluator(model).run(None, np_feeds)
    else:
        import onnxruntime as ort

        for vi in list(model.graph.input) + list(model.graph.output):
            if vi.type.tensor_type.elem_type == TensorProto.BFLOAT16:
                raise TypeError(f"onnxruntime's Python API cannot exchange bf16 tensors ({vi.name}); build the model with float32 I/O")
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        outs = sess.run(None, np_feeds)
    return {o.name: from_numpy(np.asarray(v)) for o, v in zip(model.graph.output, outs)}
