"""Reference semantics of the rollout's quantized linear layers (what every kernel must compute).

All variants dequantize operands with the SPEC §3 formula to bf16 and accumulate in float32:

* W4A16:  ``y = X @ W_hat^T``                       X bf16 as given, ``W_hat = DQ(Q_W(W))``
* W4A4:   ``y = X_hat @ W_hat^T``                   ``X_hat = DQ(Q_A(X))`` (dynamic global scale, or a
  static calibrated one: ``act_spec.global_source == 'static'`` with ``act_amax``), bf16
  saturated to the activation dtype's range (``nvfp4_act_operand``: fp16 65504 -> 65280, not 65536 = inf)
* W4A4 + RAC: ``y = X_hat @ W_hat^T + R_hat @ W_hat^T``  (two float32 accumulations; gathered mode
  uses the gathered columns of ``W_hat``), see :mod:`qpass.quant.rac`
* W8A8 FP8 (block): ``y = DQ(Q8_A(X)) @ DQ(Q8_W(W))^T`` with float32 dequantized operands

then ``+ bias`` in float32 and one rounding to the output dtype. A kernel equals this up to the
order of float32 summation only (the issue's contract: relative Frobenius error vs an fp64 product
of the same dequantized operands < 1e-5).

Because ``W_hat`` is the very tensor the learner's ``nvfp4_qdq`` produces, a W4A16 rollout and a
W4A16-QAT learner see bit-identical weights.

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
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_act_operand, nvfp4_act_quantize, nvfp4_dequantize
from qpass.quant.rac import RACConfig, rac_reference, scatter_gathered

if TYPE_CHECKING:  # the call types import this package's tensors; kernels only read their fields
    from qpass.ops.calls import FP8LinearCall, MXFP4LinearCall, NVFP4LinearCall


def _finish(acc: torch.Tensor, bias: torch.Tensor | None, lead: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*lead, acc.shape[-1]).to(dtype)


def nvfp4_linear_reference(call: "NVFP4LinearCall", *, w_hat: torch.Tensor | None = None) -> torch.Tensor:
    """The reference ``qpass::nvfp4_linear``: W4A16, W4A4 or W4A4 + RAC as ``call`` says.

    Args:
        call: the op's typed call (``x [..., K]``, NVFP4 weight ``[N, K]``, bias, activation spec,
            RAC config with its derived ``rac_k``, static channels, the calibrated ``act_amax`` of a
            static activation spec, site, output dtype).
        w_hat: optional cached ``nvfp4_dequantize(call.weight, bf16)`` (float32 or bf16).
    Returns:
        ``[..., N]`` in ``call.out_dtype``.
    Raises:
        QuantizationError: NaN/inf activations, bad static channels or calibrated amax (names the site).
    """
    x, w = call.x, call.weight
    w_hat = nvfp4_dequantize(w, torch.bfloat16) if w_hat is None else w_hat
    x2 = x.reshape(-1, x.shape[-1])
    wf = w_hat.float()
    if call.act is None:
        return _finish(x2.float() @ wf.t(), call.bias, x.shape[:-1], call.out_dtype)
    if call.rac is None:
        qa = nvfp4_act_quantize(x2, call.act, act_amax=call.act_amax, site=call.site)
        acc = nvfp4_act_operand(qa).float() @ wf.t()
        return _finish(acc, call.bias, x.shape[:-1], call.out_dtype)
    res = rac_reference(x2, call.rac, call.act, static_channels=call.rac_channels, act_amax=call.act_amax, site=call.site,
                        k=call.rac_k)
    acc = res.x_hat.float() @ wf.t()
    if res.gather_index is None:
        acc = acc + res.comp.float() @ wf.t()
    elif res.gather_index.dim() == 1:
        idx = res.gather_index
        wg = torch.where((idx >= 0).unsqueeze(0), wf[:, idx.clamp(min=0)], torch.zeros((), device=wf.device))
        acc = acc + res.comp.float() @ wg.t()
    else:  # per-token gathered: scatter back to dense columns (exact: disjoint columns per row)
        acc = acc + scatter_gathered(res.comp, res.gather_index, x2.shape[-1]) @ wf.t()
    return _finish(acc, call.bias, x.shape[:-1], call.out_dtype)


def _nvfp4_call(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None, act_spec: NVFP4Spec | None,
                rac: RACConfig | None, static_channels: torch.Tensor | None, site: str | None,
                act_amax: torch.Tensor | None = None) -> "NVFP4LinearCall":
    from qpass.ops.calls import NVFP4LinearCall

    return NVFP4LinearCall(x=x, weight=w, bias=bias, act=act_spec, rac=rac, rac_channels=static_channels,
                           site=site or "", out_dtype=x.dtype, act_amax=act_amax)


def w4a16_linear_reference(
    x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None, *, w_hat: torch.Tensor | None = None, site: str | None = None
) -> torch.Tensor:
    """NVFP4 weights, bf16 activations. ``x`` [..., K] -> [..., N] in ``x.dtype``
    (:func:`nvfp4_linear_reference` of the W4A16 call).

    ``w_hat`` (optional) is a cached ``nvfp4_dequantize(w, bf16)``.
    """
    return nvfp4_linear_reference(_nvfp4_call(x, w, bias, None, None, None, site), w_hat=w_hat)


def w4a4_linear_reference(
    x: torch.Tensor,
    w: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_spec: NVFP4Spec,
    rac: RACConfig | None = None,
    static_channels: torch.Tensor | None = None,
    act_amax: torch.Tensor | None = None,
    w_hat: torch.Tensor | None = None,
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
        w_hat: optional cached ``nvfp4_dequantize(w, bf16)``.
    Returns:
        ``[..., N]`` in ``x.dtype``.
    Raises:
        QuantizationError: K mismatch, NaN/inf activations, a static spec without ``act_amax``
            (the message names ``site``).
    """
    return nvfp4_linear_reference(_nvfp4_call(x, w, bias, act_spec, rac, static_channels, site, act_amax), w_hat=w_hat)


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
