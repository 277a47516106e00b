"""Grouped NVFP4 W4A4 experts on Triton: tokens sorted by expert, one GEMM launch per projection.

For one MoE projection (e.g. the W13 = gate/up input of every expert of a layer):

1. :func:`sort_by_expert`: the ``(token, slot)`` pairs of the router's top-k ``[T, k]`` in the
   order of the per-expert reference (expert ascending, then token ascending: the order
   ``torch.where(top_k_index == e)`` gives, :class:`qpass.moe.experts.SiteExperts`) and the segment
   offsets ``[E + 1]``.
2. per expert segment: the dynamic NVFP4 activation quantization (and RAC masked-mode residual)
   over *that expert's tokens* — the global amax and RAC's channel scores are per expert, exactly
   as the per-expert rollout op computes them (``qpass.ops.nvfp4_linear`` on the expert's rows).
3. one grouped GEMM (``kernels/nvfp4_grouped.py``) over the concatenated operands ``B_X`` / ``B_R``
   with each row's ``S_dec_X`` / ``S_dec_R`` (SPEC §3.1: ``alpha = fl(S_dec_X * S_dec_W[e])``).

Quantized operands are bit-identical to the per-expert reference (:func:`grouped_reference`,
``qpass.quant.linear.w4a4_linear_reference`` per expert); the GEMM equals each expert launched alone
with the same tiles bit for bit, and the reference up to the order of float32 summation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qpass.errors import QuantizationError
from qpass.formats.spec import NVFP4Spec
from qpass.quant.nvfp4 import NVFP4Tensor
from qpass.quant.rac import RACConfig
from qpass.backends.triton._loader import kernel_lib
from qpass.backends.triton.linear import _act_quant_operand
from qpass.backends.triton.rac import rac_run


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(token [M], slot [M], offs [E+1])`` for int64 routes ``[T, k]``: ``M = T*k`` pairs sorted by
    expert, then token (the per-expert loop's order)."""
    toks, slots, offs = [], [], [0]
    for e in range(num_experts):
        t, s = torch.where(top_k_index == e)
        toks.append(t)
        slots.append(s)
        offs.append(offs[-1] + int(t.numel()))
    return torch.cat(toks), torch.cat(slots), offs


def stack_experts(weights: Sequence[NVFP4Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [E, N, K/2] uint8, scales [E, N, K/16] uint8, s_dec [E] float32)`` of per-expert weights.

    Raises:
        QuantizationError: experts of different shapes, or a per-row global scale.
    """
    shapes = {tuple(w.codes.shape) for w in weights}
    if len(shapes) != 1:
        raise QuantizationError(f"grouped experts need one weight shape, got {sorted(shapes)}")
    codes = torch.stack([w.codes for w in weights]).contiguous()
    scales = torch.stack([w.scales.view(torch.uint8) for w in weights]).contiguous()
    sdec = torch.stack([w.s_dec.reshape(()) for w in weights]).float().contiguous()
    return codes, scales, sdec


def grouped_w4a4_triton(
    x_sorted: torch.Tensor, offs: Sequence[int], weights: Sequence[NVFP4Tensor], *, act_spec: NVFP4Spec,
    rac: RACConfig | None = None, out_dtype: torch.dtype | None = None, params: dict | None = None,
) -> torch.Tensor:
    """W4A4 (+ RAC masked mode) over experts: ``x_sorted [M, K]`` rows of expert ``e`` at
    ``offs[e]:offs[e+1]`` -> ``[M, N]`` (``out_dtype`` or ``x.dtype``).

    Raises:
        QuantizationError: RAC other than ``mode: masked`` (the grouped GEMM has no gathered
            segment), a bad shape, or (with sync checks) a NaN/inf input.
    """
    if rac is not None and rac.mode != "masked":
        raise QuantizationError(f"grouped experts support RAC mode 'masked' only, got {rac.mode!r}")
    codes, scales, sdec = stack_experts(weights)
    m, k = x_sorted.shape
    use_rac = rac is not None and rac.num_channels(k) > 0
    dev = x_sorted.device
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)  # B_X of every segment
    xs = torch.zeros(m, dtype=torch.float32, device=dev)  # S_dec_X of each row (its expert's, or its own per token)
    a2 = torch.zeros(m, k, dtype=torch.bfloat16, device=dev) if use_rac else None
    rs = torch.zeros(m, dtype=torch.float32, device=dev) if use_rac else None
    for e in range(len(offs) - 1):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        seg = x_sorted[lo:hi]
        if use_rac:
            ops = rac_run(seg, rac, act_spec, outputs="gemm")
            a[lo:hi], xs[lo:hi] = ops.b_x, ops.s_dec_x
            a2[lo:hi], rs[lo:hi] = ops.b_r, ops.s_dec_r
        else:
            a[lo:hi], xs[lo:hi] = _act_quant_operand(seg, act_spec, None)
    out = torch.empty(m, codes.shape[1], dtype=out_dtype or x_sorted.dtype, device=dev)
    return kernel_lib(dev).nvfp4_grouped.launch_grouped(a, codes, scales, sdec, list(offs), out, xs=xs, a2=a2, rs=rs,
                                                        params=params)


def grouped_reference(
    x_sorted: torch.Tensor, offs: Sequence[int], weights: Sequence[NVFP4Tensor], *, act_spec: NVFP4Spec,
    rac: RACConfig | None = None,
) -> torch.Tensor:
    """The per-expert reference: ``w4a4_linear_reference`` on each expert's rows, concatenated."""
    from qpass.quant.linear import w4a4_linear_reference

    n = weights[0].codes.shape[0]
    out = x_sorted.new_zeros(x_sorted.shape[0], n)
    for e in range(len(offs) - 1):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = w4a4_linear_reference(x_sorted[lo:hi], weights[e], act_spec=act_spec, rac=rac)
    return out
