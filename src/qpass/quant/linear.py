"""Reference semantics of the rollout's quantized linear layers (what every kernel must compute).

NVFP4 GEMMs multiply the exact operands ``B = e2m1 * s_b`` and apply the per-tensor scales once, as
the epilogue ``alpha`` (SPEC §3.1, the factored decode; what Blackwell's block-scaled MMA and vLLM's
NVFP4 linear methods compute), accumulating in float32:

* W4A16:  ``y = fl(acc(X B_W^T) * S_dec_W)``             X as given
* W4A4:   ``y = fl(acc(B_X B_W^T) * alpha)``, ``alpha = fl(S_dec_X * S_dec_W)`` (per token: per row;
  ``S_dec_X`` dynamic, or from a static calibrated amax: ``act_spec.global_source == 'static'`` with ``act_amax``)
* W4A4 + RAC: ``y = fl(acc(B_X B_W^T) * alpha_X) + fl(acc(B_R B_W[:, S]^T) * alpha_R)`` (two
  accumulations with their own ``alpha``; gathered mode uses the gathered columns of ``B_W``), see
  :mod:`qpass.quant.rac`
* W8A8 FP8 (block): ``y = DQ(Q8_A(X)) @ DQ(Q8_W(W))^T`` with float32 dequantized operands
* MXFP4 (weight-only): ``y = X @ DQ(W)^T`` (E8M0 scales are powers of two: the decode is exact)

then ``+ bias`` in float32 and one rounding to the output dtype. A kernel may sum in any order; the
accumulation's contract is SPEC §3.1's ``|acc - exact| <= gamma_K * sum|a||b|`` (``gamma_K =
K u / (1 - K u)``, ``u = 2^-24``), elementwise, tested against fp64.

The learner's weight QDQ (``qpass::nvfp4_qdq_linear``, :mod:`qpass.quant.qdq`) computes the W4A16
line with the same operands, the same ``S_dec_W`` bits and, on CPU, this very accumulation
(:func:`factored_gemm`), so learner and rollout outputs are bit-identical there.

Kernels receive the op's typed call (:mod:`qpass.ops.calls`): :func:`nvfp4_linear_reference`,
:func:`fp8_linear_reference` and :func:`mxfp4_linear_reference` take one; :func:`w4a16_linear_reference`
and :func:`w4a4_linear_reference` are keyword conveniences that build it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from qpass.formats.spec import NVFP4Spec
from qpass.quant.fp8 import fp8_dequantize, fp8_quantize
from qpass.quant.mxfp4 import mxfp4_dequantize
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_act_quantize, nvfp4_operand
from qpass.quant.rac import RACConfig, rac_reference, residual_operand, scatter_gathered

if TYPE_CHECKING:  # the call types import this package's tensors; kernels only read their fields
    from qpass.ops.calls import FP8LinearCall, MXFP4LinearCall, NVFP4LinearCall


def _finish(acc: torch.Tensor, bias: torch.Tensor | None, lead: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*lead, acc.shape[-1]).to(dtype)


def factored_gemm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``fl(acc(a @ b^T) * alpha)`` in float32: the reference accumulation of SPEC §3.1.

    Args:
        a: ``[M, K]`` exact operand (bf16/fp16/fp32 activation, or ``B_X``), any float dtype.
        b: ``[N, K]`` exact operand (``B_W``, or its gathered columns).
        alpha: float32 epilogue scale: 0-dim (per tensor) or ``[M, 1]`` (per token).
    Returns:
        float32 ``[M, N]``. ``acc`` is a float32 matmul of the float32 copies (exact products, any
        summation order; its error is within ``gamma_K * sum|a||b|``), ``alpha`` is applied once.
    """
    return (a.float() @ b.float().t()) * alpha


def nvfp4_gemm_terms(call: "NVFP4LinearCall", b_w: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The accumulations of one ``qpass::nvfp4_linear`` call as ``(a [M, K'], b [N, K'], alpha)``
    terms (SPEC §3.1): ``y = sum_t fl(acc(a_t b_t^T) * alpha_t) (+ bias)``, in this order.

    W4A16: ``[(X, B_W, S_dec_W)]``; W4A4: ``[(B_X, B_W, fl(S_dec_X * S_dec_W))]`` (``alpha`` ``[M, 1]``
    per token); W4A4 + RAC: that term, then ``(B_R, B_W or its gathered columns, fl(S_dec_R * S_dec_W))``.
    Operands are float32 (exact copies); the reference GEMM, the fp64 oracle of the tests
    (:func:`nvfp4_linear_exact`) and the diagnostics all read them from here.

    Raises:
        QuantizationError: NaN/inf activations, bad static channels (names the site).
    """
    x, w = call.x, call.weight
    b_w = nvfp4_operand(w) if b_w is None else b_w.float()
    s_w = w.s_dec.float()
    x2 = x.reshape(-1, x.shape[-1])
    if call.act is None:
        return [(x2.float(), b_w, s_w)]
    if call.rac is None:
        qa = nvfp4_act_quantize(x2, call.act, act_amax=call.act_amax, site=call.site)
        return [(nvfp4_operand(qa), b_w, qa.s_dec * s_w)]
    res = rac_reference(x2, call.rac, call.act, static_channels=call.rac_channels, act_amax=call.act_amax, site=call.site,
                        k=call.rac_k)
    terms = [(nvfp4_operand(res.qa), b_w, res.qa.s_dec * s_w)]
    b_r, alpha_r = residual_operand(res), res.qr.s_dec * s_w
    if res.gather_index is None:  # masked: M_S applied to B_R, all K columns
        terms.append((b_r, b_w, alpha_r))
    elif res.gather_index.dim() == 1:  # gathered columns of B_W (zero for the padding columns)
        idx = res.gather_index
        b_wg = torch.where((idx >= 0).unsqueeze(0), b_w[:, idx.clamp(min=0)], torch.zeros((), device=b_w.device))
        terms.append((b_r, b_wg, alpha_r))
    else:  # per-token gathered: scatter back to dense columns (exact: disjoint columns per row)
        terms.append((scatter_gathered(b_r, res.gather_index, x2.shape[-1]), b_w, alpha_r))
    return terms


def nvfp4_linear_reference(call: "NVFP4LinearCall", *, b_w: torch.Tensor | None = None) -> torch.Tensor:
    """The reference ``qpass::nvfp4_linear`` (SPEC §3.1, the factored decode)::

        W4A16      y = fl(acc(X B_W^T) * S_dec_W)
        W4A4       y = fl(acc(B_X B_W^T) * alpha),  alpha = fl(S_dec_X * S_dec_W)   (per token: per row)
        W4A4+RAC   y = fl(acc(B_X B_W^T) * alpha_X) + fl(acc(B_R B_W[:, S]^T) * alpha_R),
                   alpha_R = fl(S_dec_R * S_dec_W)                                  (no bf16 sum of X~)

    then ``+ bias`` in float32 and one rounding to ``call.out_dtype``. ``B = e2m1 * s_b`` is exact
    (:func:`qpass.quant.nvfp4.nvfp4_operand`); the residual ``R = X - DQ(Q_A(X))`` keeps the full
    dequant (:mod:`qpass.quant.rac`). Terms: :func:`nvfp4_gemm_terms`.

    Args:
        call: the op's typed call (``x [..., K]``, NVFP4 weight ``[N, K]``, bias, activation spec,
            RAC config with its derived ``rac_k``, static channels, the calibrated ``act_amax`` of a
            static activation spec, site, output dtype).
        b_w: optional cached ``nvfp4_operand(call.weight)`` (any float dtype: exact).
    Returns:
        ``[..., N]`` in ``call.out_dtype``.
    Raises:
        QuantizationError: NaN/inf activations, bad static channels or calibrated amax (names the site).
    """
    y = None
    for a, b, alpha in nvfp4_gemm_terms(call, b_w):
        t = factored_gemm(a, b, alpha)
        y = t if y is None else y + t
    return _finish(y, call.bias, call.x.shape[:-1], call.out_dtype)


def nvfp4_linear_exact(call: "NVFP4LinearCall", b_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 oracle of SPEC §3.1 for one call: ``(y, bound)``, float64 ``[M, N]`` (rows flattened).

    ``y = sum_t alpha_t * (a_t b_t^T) (+ bias)`` in float64 (exact products; the sums' fp64 error is
    ~2^-29 of the float32 bound) and ``bound = sum_t |alpha_t| * gamma_K * (|a_t| |b_t|^T) + eps``,
    ``gamma_K = K u / (1 - K u)``, ``u = 2^-24``: what the accumulations may be off by; ``eps`` adds
    one float32 rounding (``u``) of each ``fl(acc * alpha)`` term, of their sum and of the bias add,
    so ``|kernel(call) - y| <= bound`` elementwise for a float32 output of any conforming kernel.
    """
    u = 2.0 ** -24
    y = bound = None
    mag = None
    for a, b, alpha in nvfp4_gemm_terms(call, b_w):
        kk = a.shape[-1]
        gamma = kk * u / (1 - kk * u)
        al = alpha.double()
        t = al * (a.double() @ b.double().t())
        e = al.abs() * gamma * (a.double().abs() @ b.double().abs().t()) + u * t.abs()
        y = t if y is None else y + t
        bound = e if bound is None else bound + e
        mag = t.abs() if mag is None else mag + t.abs()
    if call.bias is not None:
        y = y + call.bias.double()
        mag = mag + call.bias.double().abs()
    return y, bound + 2 * u * mag


def _nvfp4_call(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None, act_spec: NVFP4Spec | None,
                rac: RACConfig | None, static_channels: torch.Tensor | None, site: str | None,
                act_amax: torch.Tensor | None = None) -> "NVFP4LinearCall":
    from qpass.ops.calls import NVFP4LinearCall

    return NVFP4LinearCall(x=x, weight=w, bias=bias, act=act_spec, rac=rac, rac_channels=static_channels,
                           site=site or "", out_dtype=x.dtype, act_amax=act_amax)


def w4a16_linear_reference(
    x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None, *, b_w: torch.Tensor | None = None, site: str | None = None
) -> torch.Tensor:
    """NVFP4 weights, bf16 activations. ``x`` [..., K] -> [..., N] in ``x.dtype``
    (:func:`nvfp4_linear_reference` of the W4A16 call).

    ``b_w`` (optional) is a cached ``nvfp4_operand(w)``.
    """
    return nvfp4_linear_reference(_nvfp4_call(x, w, bias, None, None, None, site), b_w=b_w)


def w4a4_linear_reference(
    x: torch.Tensor,
    w: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_spec: NVFP4Spec,
    rac: RACConfig | None = None,
    static_channels: torch.Tensor | None = None,
    act_amax: torch.Tensor | None = None,
    b_w: torch.Tensor | None = None,
    site: str | None = None,
) -> torch.Tensor:
    """NVFP4 weights and NVFP4-quantized activations (dynamic or calibrated global scale), optional RAC
    (:func:`nvfp4_linear_reference` of the W4A4 call).

    Args:
        x: bf16/fp16/fp32 ``[..., K]`` (all leading dims are one forward batch of tokens).
        w: quantized weight ``[N, K]``.
        bias: optional ``[N]``.
        act_spec: activation spec (per-tensor or per-token dynamic global scale, or per-tensor static).
        rac: residual compensation options, or None for plain W4A4 (ratio 0 is plain W4A4 too).
        static_channels: calibrated channels for ``rac.selection == 'static'``.
        act_amax: float32 0-d calibrated amax for a static ``act_spec`` (SPEC §3 with rule 5's global
            scale from calibration: :func:`qpass.quant.nvfp4.nvfp4_quantize_static`).
        b_w: optional cached ``nvfp4_operand(w)``.
    Returns:
        ``[..., N]`` in ``x.dtype``.
    Raises:
        QuantizationError: K mismatch, NaN/inf activations, a static spec without ``act_amax``
            (the message names ``site``).
    """
    return nvfp4_linear_reference(_nvfp4_call(x, w, bias, act_spec, rac, static_channels, site, act_amax), b_w=b_w)


def fp8_linear_reference(call: "FP8LinearCall", *, w_deq: torch.Tensor | None = None) -> torch.Tensor:
    """The reference ``qpass::fp8_linear``: activations quantized per ``call.act`` (e.g. 1x128 blocks),
    weights pre-quantized; ``w_deq`` an optional cached float32 ``fp8_dequantize(call.weight)``."""
    x = call.x
    wf = fp8_dequantize(call.weight, torch.float32) if w_deq is None else w_deq
    x2 = x.reshape(-1, x.shape[-1])
    qa = fp8_quantize(x2, spec=call.act, name="activation", site=call.site)
    acc = fp8_dequantize(qa, torch.float32) @ wf.t()
    return _finish(acc, call.bias, x.shape[:-1], call.out_dtype)


def mxfp4_linear_reference(call: "MXFP4LinearCall", *, w_hat: torch.Tensor | None = None) -> torch.Tensor:
    """The reference ``qpass::mxfp4_linear``: ``x @ DQ(W)^T`` in float32 (``w_hat`` an optional cached
    bf16 decode)."""
    x = call.x
    w_hat = mxfp4_dequantize(call.weight, torch.bfloat16) if w_hat is None else w_hat
    acc = x.reshape(-1, x.shape[-1]).float() @ w_hat.float().t()
    return _finish(acc, call.bias, x.shape[:-1], call.out_dtype)
