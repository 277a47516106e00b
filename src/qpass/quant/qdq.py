"""Learner-side fake quantization as ``torch.library`` custom ops (survive ``torch.export``).

Ops (namespace ``qpass``):

* ``qpass::group_amax(Tensor[] tensors) -> Tensor``: float32 0-dim ``max_i max|t_i|``; its inputs
  *are* the quantization group, so the parity checker reads groups off the graph. Not
  differentiable (the global scale is a constant for the STE).
* ``qpass::nvfp4_qdq(Tensor w, Tensor amax, str site) -> Tensor``: ``DQ(Q(w))`` with the reference
  NVFP4 weight quantizer (SPEC §3), output dtype = ``w.dtype``. Backward is the straight-through
  estimator ``dL/dw = dL/dw_hat`` (QUADS learner side; no clipping: with a fresh amax every |w| is
  inside the range).
* ``qpass::nvfp4_act_qdq(Tensor x, str site, bool per_token) -> Tensor``: dynamic activation QDQ
  (per-tensor or per-token global scale), STE backward. Used by the symmetric W4A4-QAT ablation and
  by the W16A4 rollout ablation.

Each op has a fake (meta) kernel, so ``torch.export`` and ``run_decompositions`` keep it as one
node. Errors name the ``site`` string carried by the node.
"""

from __future__ import annotations

import torch

from qpass.formats.spec import FP8Spec, MXFP4Spec, NVFP4_WEIGHT, NVFP4Spec, QuantSpec, nvfp4_weight_spec
from qpass.quant.groups import member_amax
from qpass.quant.nvfp4 import nvfp4_act_spec, nvfp4_dequantize, nvfp4_quantize
from qpass.quant.reuse import amax_bits, memo, reuse_active
from qpass.tables import backend_quantize


@torch.library.custom_op("qpass::group_amax", mutates_args=())
def group_amax_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float32 0-dim max|t| over all tensors (exact).

    Inside :func:`qpass.quant.reuse.reuse_weight_quantization` each member's max|t| is computed once
    per tensor version (:func:`qpass.quant.groups.member_amax`).
    """
    return torch.stack([member_amax(t) for t in tensors]).amax()


@group_amax_op.register_fake
def _group_amax_fake(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].new_empty((), dtype=torch.float32)


def _no_grad_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.n = len(inputs[0])


def _no_grad_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    return [None] * ctx.n  # the global scale is a constant for the straight-through estimator


group_amax_op.register_autograd(_no_grad_backward, setup_context=_no_grad_setup)


@torch.library.custom_op("qpass::nvfp4_qdq", mutates_args=())
def nvfp4_qdq_op(w: torch.Tensor, amax: torch.Tensor, site: str, arithmetic: str = "te_reference") -> torch.Tensor:
    """Reference NVFP4 weight fake-quant (see module docstring); ``arithmetic`` = ``NVFP4Spec.arithmetic``
    (``te_reference`` | ``modelopt``; graphs built before the option call it with three arguments).

    Inside :func:`qpass.quant.reuse.reuse_weight_quantization` the dequantized weight is computed
    once per ``(w version, amax bits, arithmetic)`` and a clone is returned (a write to ``w``, e.g.
    an optimizer step, invalidates it); outside it every call quantizes. The quantizer is the kernel
    backend's in effect (:func:`qpass.tables.backend_quantize`: the Triton kernel under
    ``use_kernels("triton")`` on CUDA, byte-identical to the reference).
    """

    def compute() -> torch.Tensor:
        q = backend_quantize(nvfp4_weight_spec(arithmetic), w, amax, site=site or None, name="weight")
        return nvfp4_dequantize(q, w.dtype)

    if not reuse_active():
        return compute()
    return memo("nvfp4_qdq", (w,), (amax_bits(amax), arithmetic), compute).clone()


@nvfp4_qdq_op.register_fake
def _nvfp4_qdq_fake(w: torch.Tensor, amax: torch.Tensor, site: str, arithmetic: str = "te_reference") -> torch.Tensor:
    return torch.empty_like(w)


def _ste_setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library signature
    pass


def _ste_weight_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    return grad, None, None, None


nvfp4_qdq_op.register_autograd(_ste_weight_backward, setup_context=_ste_setup)


@torch.library.custom_op("qpass::nvfp4_act_qdq", mutates_args=())
def nvfp4_act_qdq_op(x: torch.Tensor, site: str, per_token: bool) -> torch.Tensor:
    """Dynamic NVFP4 activation fake-quant over the last dim (global scale from the current x).

    An input without rows (an MoE expert no token was routed to) is returned as an empty copy.
    """
    if x.numel() == 0:
        return x.clone()
    q = nvfp4_quantize(x, spec=nvfp4_act_spec(per_token), name="activation", site=site or None)
    return nvfp4_dequantize(q, x.dtype)


@nvfp4_act_qdq_op.register_fake
def _nvfp4_act_qdq_fake(x: torch.Tensor, site: str, per_token: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _ste_act_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    return grad, None, None


nvfp4_act_qdq_op.register_autograd(_ste_act_backward, setup_context=_ste_setup)


def nvfp4_qdq(w: torch.Tensor, amax: torch.Tensor | None = None, site: str = "", arithmetic: str = "te_reference") -> torch.Tensor:
    """Straight-through NVFP4 fake quant of a weight: ``DQ(Q(w))`` forward, identity backward.

    Args:
        w: bf16/fp16/fp32 weight ``(N, K)``, ``K % 16 == 0``.
        amax: float32 0-dim group amax; ``None`` = ``max|w|`` (a group of one).
        site: site id used in error messages.
        arithmetic: ``te_reference`` (SPEC §3) or ``modelopt`` (``NVFP4Spec.arithmetic``).
    Returns:
        Tensor like ``w``: the dequantized weight, bit-identical to
        ``nvfp4_dequantize(nvfp4_quantize(w, amax, spec=nvfp4_weight_spec(arithmetic)), w.dtype)``.
    Raises:
        QuantizationError: as :func:`qpass.quant.nvfp4.nvfp4_quantize`.
    """
    if amax is None:
        amax = group_amax_op([w])
    if arithmetic == "te_reference":
        return nvfp4_qdq_op(w, amax, site)
    return nvfp4_qdq_op(w, amax, site, arithmetic)


@torch.library.custom_op("qpass::qdq", mutates_args=())
def qdq_op(x: torch.Tensor, amax: torch.Tensor | None, spec: str, site: str) -> torch.Tensor:
    """Fake quant ``DQ(Q(x))`` for any canonical spec (``spec`` = its key), output dtype = ``x.dtype``.

    NVFP4 weights take the group ``amax`` (or None = max|x|); other specs compute their scales
    from ``x``. Backward is the straight-through estimator.
    """
    from qpass.tables import reference_qdq

    return reference_qdq(spec, x, amax, site or None)


@qdq_op.register_fake
def _qdq_fake(x: torch.Tensor, amax: torch.Tensor | None, spec: str, site: str) -> torch.Tensor:
    return torch.empty_like(x)


def _ste_qdq_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    return grad, None, None, None


qdq_op.register_autograd(_ste_qdq_backward, setup_context=_ste_setup)


def _register_tables() -> None:
    from qpass.tables import LearnerQDQ, register

    def nvfp4(spec: NVFP4Spec, x: torch.Tensor, amax: torch.Tensor | None = None, site: str = "") -> torch.Tensor:
        if spec.role == "weight":
            return nvfp4_qdq(x, amax, site, spec.arithmetic)
        return nvfp4_act_qdq_op(x, site, spec.global_scope == "per_token")

    def generic(spec: QuantSpec, x: torch.Tensor, amax: torch.Tensor | None = None, site: str = "") -> torch.Tensor:
        return qdq_op(x, amax, spec.key, site)

    register("learner_qdq", NVFP4Spec)(LearnerQDQ({"weight": "qpass::nvfp4_qdq", "activation": "qpass::nvfp4_act_qdq"}, nvfp4))
    for t in (MXFP4Spec, FP8Spec):
        register("learner_qdq", t)(LearnerQDQ({"weight": "qpass::qdq", "activation": "qpass::qdq"}, generic))


_register_tables()
