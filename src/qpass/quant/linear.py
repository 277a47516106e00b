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
"""

from __future__ import annotations

import torch

from qpass.errors import QuantizationError
from qpass.formats.spec import FP8Spec, NVFP4Spec
from qpass.quant.fp8 import FP8Tensor, fp8_dequantize, fp8_quantize
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_act_operand, nvfp4_act_quantize, nvfp4_dequantize
from qpass.quant.rac import RACConfig, rac_num_channels, rac_reference, scatter_gathered


def _finish(acc: torch.Tensor, bias: torch.Tensor | None, lead: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*lead, acc.shape[-1]).to(dtype)


def _check_x(x: torch.Tensor, k: int, site: str | None) -> None:
    if x.shape[-1] != k:
        raise QuantizationError(f"input has K={x.shape[-1]} but the weight has K={k} at site {site}")


def w4a16_linear_reference(
    x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None, *, w_hat: torch.Tensor | None = None, site: str | None = None
) -> torch.Tensor:
    """NVFP4 weights, bf16 activations. ``x`` [..., K] -> [..., N] in ``x.dtype``.

    ``w_hat`` (optional) is a cached ``nvfp4_dequantize(w, bf16)``.
    """
    _check_x(x, w.shape[-1], site)
    w_hat = nvfp4_dequantize(w, torch.bfloat16) if w_hat is None else w_hat
    x2 = x.reshape(-1, x.shape[-1])
    acc = x2.float() @ w_hat.float().t()
    return _finish(acc, bias, x.shape[:-1], x.dtype)


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
    """NVFP4 weights and NVFP4-quantized activations (dynamic or calibrated global scale), optional RAC.

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
    _check_x(x, w.shape[-1], site)
    w_hat = nvfp4_dequantize(w, torch.bfloat16) if w_hat is None else w_hat
    x2 = x.reshape(-1, x.shape[-1])
    wf = w_hat.float()
    if rac is None or rac_num_channels(x2.shape[-1], rac.ratio) == 0:
        qa = nvfp4_act_quantize(x2, act_spec, act_amax=act_amax, site=site)
        acc = nvfp4_act_operand(qa).float() @ wf.t()
        return _finish(acc, bias, x.shape[:-1], x.dtype)
    res = rac_reference(x2, rac, act_spec, static_channels=static_channels, act_amax=act_amax, site=site)
    acc = res.x_hat.float() @ wf.t()
    if res.gather_index is None:
        acc = acc + res.comp.float() @ wf.t()
    elif res.gather_index.dim() == 1:
        idx = res.gather_index
        wg = torch.where((idx >= 0).unsqueeze(0), wf[:, idx.clamp(min=0)], torch.zeros((), device=wf.device))
        acc = acc + res.comp.float() @ wg.t()
    else:  # per-token gathered: scatter back to dense columns (exact: disjoint columns per row)
        acc = acc + scatter_gathered(res.comp, res.gather_index, x2.shape[-1]) @ wf.t()
    return _finish(acc, bias, x.shape[:-1], x.dtype)


def fp8_linear_reference(
    x: torch.Tensor,
    w: FP8Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_spec: FP8Spec,
    w_deq: torch.Tensor | None = None,
    site: str | None = None,
) -> torch.Tensor:
    """FP8 W8A8: activations quantized per ``act_spec`` (e.g. 1x128 blocks), weights pre-quantized."""
    _check_x(x, w.shape[-1], site)
    wf = fp8_dequantize(w, torch.float32) if w_deq is None else w_deq
    x2 = x.reshape(-1, x.shape[-1])
    qa = fp8_quantize(x2, spec=act_spec, name="activation", site=site)
    acc = fp8_dequantize(qa, torch.float32) @ wf.t()
    return _finish(acc, bias, x.shape[:-1], x.dtype)
