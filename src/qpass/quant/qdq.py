"""Learner-side fake quantization as ``torch.library`` custom ops (survive ``torch.export``).

Ops (namespace ``qpass``):

* ``qpass::group_amax(Tensor[] tensors) -> Tensor``: float32 0-dim ``max_i max|t_i|``; its inputs
  *are* the quantization group, so the parity checker reads groups off the graph. Not
  differentiable (the global scale is a constant for the STE).
* ``qpass::nvfp4_qdq_linear(Tensor x, Tensor w, Tensor amax, Tensor? bias, str site, str arithmetic)
  -> Tensor``: the learner's weight-QDQ linear, factored as the rollout's GEMMs are (SPEC §3.1):
  ``y = fl(acc(X B_W^T) * S_dec_W)``; STE backward with ``W_hat = B_W * S_dec_W`` as the weight
  (``dL/dW = dL/dW_hat``, ``dL/dX = S_dec_W * (dL/dY B_W)``). What the ``weight_qdq`` pass emits
  (QUADS learner side; no clipping: with a fresh amax every |w| is inside the range).
* ``qpass::qdq_linear(Tensor x, Tensor w, Tensor? bias, str spec, str site) -> Tensor``: the same for a
  weight spec without a global scale (FP8, MXFP4): ``y = fl(acc(X W_hat^T))`` with the float32 decode
  the rollout's reference op multiplies, STE backward.
* ``qpass::nvfp4_qdq(Tensor w, Tensor amax, str site) -> Tensor``: the materialised ``W_hat =
  DQ(Q(w))`` (SPEC §3 dequant), output dtype = ``w.dtype``, straight-through backward: for
  consumers that need a dense weight (probes, diagnostics), not for the learner's GEMMs.
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
from qpass.quant.nvfp4 import nvfp4_act_spec, nvfp4_dequantize, nvfp4_operand, nvfp4_quantize
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


def learner_weight_operand(w: torch.Tensor, amax: torch.Tensor, site: str = "", arithmetic: str = "te_reference"
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_W, S_dec_W)``: what the learner's weight QDQ multiplies (SPEC §3.1).

    ``B_W = nvfp4_operand(Q(w))`` ``[N, K]`` held in bf16 (exact: half the memory of float32 for the
    cache; consumers upcast, also exact) and ``S_dec_W`` the float32 0-dim decode
    global scale of the same quantization (the kernel backend's quantizer in effect,
    :func:`qpass.tables.backend_quantize`; byte-identical to the reference). Inside
    :func:`qpass.quant.reuse.reuse_weight_quantization` computed once per ``(w version, amax bits,
    arithmetic)``; callers must not write into the result.
    """

    def compute() -> tuple[torch.Tensor, torch.Tensor]:
        q = backend_quantize(nvfp4_weight_spec(arithmetic), w.detach(), amax.detach(), site=site or None, name="weight")
        return nvfp4_operand(q, torch.bfloat16), q.s_dec.float()

    if not reuse_active():
        return compute()
    return memo("nvfp4_operand", (w,), (amax_bits(amax), arithmetic), compute)


def _learner_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 ``acc(a @ b^T)`` of exact operands. CPU (and fp32 ``a``): the rollout reference's own
    float32 matmul (:func:`qpass.quant.linear.factored_gemm`), so learner and rollout outputs are
    bit-identical; CUDA with a bf16/fp16 activation: the tensor-core GEMM with a float32 output
    (``b`` is exact in that dtype), the learner's speed path."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b.to(a.dtype).t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm(..., out_dtype=)
            pass
    return a.float() @ b.float().t()


@torch.library.custom_op("qpass::nvfp4_qdq_linear", mutates_args=())
def nvfp4_qdq_linear_op(x: torch.Tensor, w: torch.Tensor, amax: torch.Tensor, bias: torch.Tensor | None, site: str,
                        arithmetic: str = "te_reference") -> torch.Tensor:
    """The learner's weight-QDQ linear (W4A16 QAT, SPEC §3.1): ``y = fl(acc(X B_W^T) * S_dec_W) (+ bias)``.

    Args:
        x: ``[..., K]`` in the model dtype. w: the BF16 master weight ``[N, K]`` (``K % 16 == 0``).
        amax: float32 0-dim group amax (``qpass::group_amax`` of the fused group, fresh every forward).
        bias: ``[N]`` or None. site: the site id (errors name it). arithmetic: ``NVFP4Spec.arithmetic``.
    Returns:
        ``[..., N]`` in ``x.dtype``; on CPU bit-identical to the rollout's reference W4A16 op on the
        rollout's bytes of the same weights (same ``B_W``, same ``S_dec_W`` bits, same accumulation).
    Backward (the straight-through estimator with ``W_hat = B_W * S_dec_W`` as the weight):
    ``dL/dX = fl(S_dec_W * (dL/dY B_W))``, ``dL/dW = dL/dW_hat = dL/dY^T X``, ``dL/dbias = sum dL/dY``;
    no gradient to ``amax`` (the global scale is a constant of the STE).
    Raises:
        QuantizationError: as :func:`qpass.quant.nvfp4.nvfp4_quantize` (names the site).
    """
    b_w, s_dec = learner_weight_operand(w, amax, site, arithmetic)
    x2 = x.reshape(-1, x.shape[-1])
    y = _learner_gemm(x2, b_w) * s_dec
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


@nvfp4_qdq_linear_op.register_fake
def _nvfp4_qdq_linear_fake(x, w, amax, bias, site, arithmetic="te_reference"):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _qdq_linear_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, w, amax, bias, site = inputs[:5]
    ctx.save_for_backward(x, w, amax)
    ctx.site = site
    ctx.arithmetic = inputs[5] if len(inputs) > 5 else "te_reference"
    ctx.bias_dtype = None if bias is None else bias.dtype


def _qdq_linear_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    x, w, amax = ctx.saved_tensors
    n, k = w.shape
    g2 = grad.reshape(-1, n)
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        b_w, s_dec = learner_weight_operand(w, amax, ctx.site, ctx.arithmetic)
        gx = ((g2.float() @ b_w.float()) * s_dec).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[1]:
        gw = (g2.float().t() @ x.reshape(-1, k).float()).to(w.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
        gb = g2.float().sum(0).to(ctx.bias_dtype)
    return gx, gw, None, gb, None, None


nvfp4_qdq_linear_op.register_autograd(_qdq_linear_backward, setup_context=_qdq_linear_setup)


@torch.library.custom_op("qpass::nvfp4_operand_ste", mutates_args=())
def nvfp4_operand_ste_op(w: torch.Tensor, amax: torch.Tensor, site: str) -> torch.Tensor:
    """``B_W = e2m1 * s_b`` of ``w``'s NVFP4 quantization (SPEC §3.1) in ``w.dtype`` (exact), for a
    learner whose matmul is not qpass's (Megatron's fused linears): it multiplies ``B_W`` and scales
    its output by ``S_dec_W``. Backward: ``dL/dW = fl(dL/dB_W / S_dec_W)`` (the straight-through
    estimator of ``W_hat = B_W * S_dec_W``); no gradient to ``amax``."""
    return learner_weight_operand(w, amax, site)[0].to(w.dtype)


@nvfp4_operand_ste_op.register_fake
def _nvfp4_operand_ste_fake(w: torch.Tensor, amax: torch.Tensor, site: str) -> torch.Tensor:
    return torch.empty_like(w)


def _operand_ste_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(inputs[1])


def _operand_ste_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    from qpass.quant.nvfp4 import global_scales

    (amax,) = ctx.saved_tensors
    s_dec = global_scales(amax)[1]
    return (grad.float() / s_dec).to(grad.dtype), None, None


nvfp4_operand_ste_op.register_autograd(_operand_ste_backward, setup_context=_operand_ste_setup)


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


def learner_dense_operand(w: torch.Tensor, spec_key: str, site: str = "") -> torch.Tensor:
    """The float32 weight operand ``DQ(Q(w))`` of a spec without a factored decode (FP8, MXFP4): what
    the rollout's reference op multiplies (``fp8_dequantize(w, float32)``; the MXFP4 decode, exact).
    Memoized inside :func:`qpass.quant.reuse.reuse_weight_quantization`; callers must not write into it."""
    from qpass.formats.spec import spec_by_key
    from qpass.tables import backend_quantize

    spec = spec_by_key(spec_key)
    compute = lambda: backend_quantize(spec, w.detach(), site=site or None, name="weight").dequantize(torch.float32)  # noqa: E731
    if not reuse_active():
        return compute()
    return memo("dense_operand", (w,), (spec_key,), compute)


@torch.library.custom_op("qpass::qdq_linear", mutates_args=())
def qdq_linear_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, spec: str, site: str) -> torch.Tensor:
    """The learner's weight-QDQ linear for a weight spec without a global scale (FP8 blocks /
    per tensor, MXFP4; ``spec`` = its key): ``y = fl(acc(X W_hat^T)) (+ bias)`` with ``W_hat`` the
    float32 decode the rollout's reference op multiplies (:func:`learner_dense_operand`), so learner
    and rollout multiply the same weight operand. Backward: the STE (``dL/dW = dY^T X``,
    ``dL/dX = dY W_hat``). Raises as the spec's quantizer (names the site)."""
    w_op = learner_dense_operand(w, spec, site)
    x2 = x.reshape(-1, x.shape[-1])
    y = x2.float() @ w_op.t()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


@qdq_linear_op.register_fake
def _qdq_linear_fake(x, w, bias, spec, site):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _dense_linear_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, w, bias, spec, site = inputs
    ctx.save_for_backward(x, w)
    ctx.spec, ctx.site, ctx.bias_dtype = spec, site, None if bias is None else bias.dtype


def _dense_linear_backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    x, w = ctx.saved_tensors
    n, k = w.shape
    g2 = grad.reshape(-1, n).float()
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = (g2 @ learner_dense_operand(w, ctx.spec, ctx.site)).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[1]:
        gw = (g2.t() @ x.reshape(-1, k).float()).to(w.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        gb = g2.sum(0).to(ctx.bias_dtype)
    return gx, gw, gb, None, None


qdq_linear_op.register_autograd(_dense_linear_backward, setup_context=_dense_linear_setup)


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

    def nvfp4_linear_args(spec: NVFP4Spec, x, w, amax, bias, site):  # noqa: ANN001, ANN202
        return (x, w, amax, bias, site) + (() if spec.arithmetic == "te_reference" else (spec.arithmetic,))

    def nvfp4_act_args(spec: NVFP4Spec, x, site):  # noqa: ANN001, ANN202
        return (x, site, spec.global_scope == "per_token")

    def generic_linear_args(spec: QuantSpec, x, w, amax, bias, site):  # noqa: ANN001, ANN202
        return (x, w, bias, spec.key, site)

    def generic_act_args(spec: QuantSpec, x, site):  # noqa: ANN001, ANN202
        return (x, None, spec.key, site)

    register("learner_qdq", NVFP4Spec, claim=True)(LearnerQDQ(
        {"weight": "qpass::nvfp4_qdq", "activation": "qpass::nvfp4_act_qdq", "linear": "qpass::nvfp4_qdq_linear"},
        nvfp4, nvfp4_linear_args, nvfp4_act_args))
    for t in (MXFP4Spec, FP8Spec):
        register("learner_qdq", t, claim=True)(LearnerQDQ(
            {"weight": "qpass::qdq", "activation": "qpass::qdq", "linear": "qpass::qdq_linear"}, generic,
            generic_linear_args, generic_act_args))


_register_tables()
