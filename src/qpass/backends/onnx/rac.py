"""Residual activation compensation (SPEC §2) as ONNX nodes, equal to :func:`qpass.quant.rac.rac_reference`.

The channel selection must be the reference's exactly, so the ``batch`` score is the same
fixed-point integer sum (``floor(fl(R^2) * 2^shift)`` as int64, summed over rows; integer addition
has no order) and ``TopK`` breaks ties toward the lower index (ONNX TopK contract; checked on
onnxruntime 1.32 and the ReferenceEvaluator). The shift's ``frexp`` exponent of ``amax(X)`` and
``ceil(log2 M)`` are counted against exact power-of-two tables (no ``Log``, no ``Pow``).

Outputs feed two accumulations exactly as :func:`qpass.quant.linear.nvfp4_linear_reference` (SPEC
§3.1): ``B_X`` with ``S_dec_X`` and the compensation operand ``B_R`` with ``S_dec_R`` (masked:
``[M, K]``, zero outside the selected channels; gathered: ``[M, K']`` plus the index that picks
``B_W``'s columns). The residual itself is formed from the dense ``x_hat`` (``R = X - DQ(Q_A(X))``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from onnx import TensorProto

from qpass.quant.rac import BLOCK, RACConfig, ceil16

from qpass.backends.onnx.builder import GraphBuilder
from qpass.backends.onnx.emit import F, nvfp4_activation, nvfp4_activation_operand

BF16 = TensorProto.BFLOAT16
I64 = TensorProto.INT64
POW2_MIN, POW2_MAX = -149, 127  # float32 powers of two, subnormal to max
SHIFT_LIMIT = 100


@dataclasses.dataclass(frozen=True)
class RACValues:
    """ONNX value names produced by :func:`emit_rac`.

    Attributes:
        b_x: float32 ``[M, K]``: ``B_X = e2m1 * s_b`` of ``Q_A(X)``; s_dec_x its global scale
            (scalar, or ``[M, 1]`` per token).
        comp: float32 compensation operand ``B_R``: ``[M, K]`` (masked mode, and gathered
            per-token selections scattered back to dense columns) or ``[M, K']`` (gathered with one
            channel list for the batch); s_dec_r its global scale.
        columns: for ``[M, K']`` operands, int64 ``[k]`` channel ids whose ``B_W`` columns the second
            GEMM uses (the ``K' - k`` padding columns are zero); None otherwise.
        k_pad: ``K'`` (0 when ``columns`` is None).
    """

    b_x: str
    s_dec_x: str
    comp: str
    s_dec_r: str
    columns: str | None
    k_pad: int


def _count_ge(b: GraphBuilder, value: str, table: list[float], elem_type: int, hint: str, strict: bool = False) -> str:
    """int64 number of table entries ``<= value`` (``< value`` with ``strict``)."""
    if elem_type == F:
        tab = b.table(table, f"{hint}_table")
    else:
        import numpy as np

        tab = b.initializer(np.array(table, dtype=np.int64), f"{hint}_table")
    hit = b.op("Less" if strict else "LessOrEqual", [tab, value], f"{hint}_hit")
    return b.op("ReduceSum", [b.op("Cast", [hit], f"{hint}_hit_i", to=I64)], hint, keepdims=0)


def score_shift(b: GraphBuilder, amax: str, rows: str) -> str:
    """int64 scalar ``clamp(61 - ceil(log2 M) - 2 e_a, -100, 100)`` (0 when amax == 0), see
    :func:`qpass.quant.rac.score_shift`. ``amax``: float32 scalar; ``rows``: int64 scalar M."""
    # amax = f * 2^e_a, f in [0.5, 1): e_a = floor(log2 amax) + 1 = #{i: 2^i <= amax} - 149
    e_a = b.op("Sub", [_count_ge(b, amax, [math.ldexp(1.0, i) for i in range(POW2_MIN, POW2_MAX + 1)], F, "pow2_le_amax"), b.i64(-POW2_MIN)], "e_a")
    # ceil(log2 M) for M >= 1 = #{j >= 0: 2^j < M}
    c = _count_ge(b, rows, [1 << j for j in range(63)], I64, "ceil_log2_m", strict=True)
    raw = b.op("Sub", [b.op("Sub", [b.i64(61), c], "s61_c"), b.op("Mul", [b.i64(2), e_a], "two_e_a")], "shift_raw")
    clamped = b.op("Max", [b.op("Min", [raw, b.i64(SHIFT_LIMIT)], "shift_hi"), b.i64(-SHIFT_LIMIT)], "shift_clamped")
    return b.op("Where", [b.op("Equal", [amax, b.f32(0.0)], "amax_zero"), b.i64(0), clamped], "shift")


def channel_scores(b: GraphBuilder, r: str, amax: str) -> str:
    """int64 ``[K]`` exact residual energy per channel (:func:`qpass.quant.rac.channel_scores`)."""
    rows = b.op("Squeeze", [b.op("Slice", [b.op("Shape", [r], "r_shape"), b.i64([0]), b.i64([1])], "m_1d"), b.i64([0])], "m")
    shift = score_shift(b, amax, rows)
    pow2 = b.op("Gather", [b.table([math.ldexp(1.0, s) for s in range(-SHIFT_LIMIT, SHIFT_LIMIT + 1)], "pow2_shift_table"),
                           b.op("Add", [shift, b.i64(SHIFT_LIMIT)], "shift_idx")], "pow2_shift", axis=0)
    scaled = b.op("Mul", [b.op("Mul", [r, r], "r_sq"), pow2], "r_sq_scaled")
    terms = b.op("Cast", [b.op("Floor", [scaled], "terms_f")], "terms", to=I64)
    return b.op("ReduceSum", [terms, b.i64([0])], "scores", keepdims=0)


def _topk_sorted(b: GraphBuilder, scores: str, k: int) -> str:
    """Indices of the ``k`` largest along the last axis (ties -> lower index), sorted ascending."""
    _, idx = _topk(b, scores, k, largest=1)
    vals, _ = _topk(b, idx, k, largest=0)
    return vals


def _topk(b: GraphBuilder, x: str, k: int, *, largest: int) -> tuple[str, str]:
    v, i = b.fresh("topk_values"), b.fresh("topk_indices")
    from onnx import helper

    b.nodes.append(helper.make_node("TopK", [x, b.i64([k])], [v, i], name=b.fresh("n_topk"), axis=-1, largest=largest, sorted=1))
    return v, i


def emit_rac(
    b: GraphBuilder, x2: str, k_dim: int, cfg: RACConfig, *, per_token: bool, static_channels: torch.Tensor | None, site: str,
    operand_limit: float | None = None,
) -> RACValues:
    """Quantize float32 activations ``x2`` ``[M, K]`` with residual compensation.

    ``operand_limit``: bound of the activation operand ``x_hat`` (``act_operand_limit`` of the
    activation dtype; the residual is formed from the bounded ``x_hat``, as in ``rac_reference``).

    Raises:
        ValueError: ``selection='static'`` without channels, or channels out of range (names ``site``).
    """
    x_hat = b.op("Cast", [nvfp4_activation(b, x2, k_dim, elem_type=F, dtype=BF16, per_token=per_token,
                                           operand_limit=operand_limit)], "x_hat_f", to=F)
    b_x, s_dec_x = nvfp4_activation_operand(b, x2, k_dim, elem_type=F, per_token=per_token)
    r = b.op("Sub", [x2, x_hat], "residual")
    k = cfg.num_channels(k_dim)
    if cfg.selection == "static":
        if static_channels is None:
            raise ValueError(f"RAC selection 'static' needs calibrated channels at site {site}")
        ch_t = torch.sort(static_channels.to(torch.int64).flatten()).values
        if ch_t.numel() and (int(ch_t.min()) < 0 or int(ch_t.max()) >= k_dim):
            raise ValueError(f"static RAC channels out of range [0, {k_dim}) at site {site}")
        ch = b.torch_initializer(ch_t, f"{site}.rac_channels")
        k = ch_t.numel()
    elif cfg.selection == "batch":
        amax = b.op("ReduceMax", [b.op("Abs", [x2], "x_abs_all")], "amax_x", keepdims=0)
        ch = _topk_sorted(b, channel_scores(b, r, amax), k)
    else:  # token: rank each row's |R| (exact)
        ch = _topk_sorted(b, b.op("Abs", [r], "r_abs"), k)
    per_row = cfg.selection == "token"
    if cfg.mode == "masked":
        r_b, s_dec_r = nvfp4_activation_operand(b, r, k_dim, elem_type=F, per_token=per_token)
        base = r if per_row else b.op("Slice", [r, b.i64([0]), b.i64([1]), b.i64([0])], "r_row0")  # shape donor
        zeros = b.op("Mul", [base, b.f32(0.0)], "mask_zeros")  # +0.0 (r is finite or the output is NaN anyway)
        zeros = b.op("Abs", [zeros], "mask_zeros_pos")
        ones = b.op("Add", [b.op("Mul", [b.op("Cast", [ch], "ch_f", to=F), b.f32(0.0)], "ch_zero"), b.f32(1.0)], "ch_ones")
        axis = 1 if per_row else -1
        if not per_row:
            ch_row, ones = b.op("Unsqueeze", [ch, b.i64([0])], "ch_row"), b.op("Unsqueeze", [ones, b.i64([0])], "ones_row")
        else:
            ch_row = ch
        mask = b.op("ScatterElements", [zeros, ch_row, ones], "mask_f", axis=axis)
        mask = b.op("Greater", [mask, b.f32(0.0)], "mask")
        comp = b.op("Where", [mask, r_b, b.f32(0.0)], "comp")
        return RACValues(b_x, s_dec_x, comp, s_dec_r, None, 0)
    kp = max(ceil16(k), BLOCK)
    if per_row:  # GatherElements along axis 1, written as a flat Gather (the ONNX reference
        # evaluator's GatherElements fails for K > 64: numpy.choose's 64-choice limit)
        rows = b.op("Squeeze", [b.op("Slice", [b.op("Shape", [r], "r_shape_g"), b.i64([0]), b.i64([1])], "m_1d_g"), b.i64([0])], "m_g")
        offs = b.op("Mul", [b.op("Range", [b.i64(0), rows, b.i64(1)], "row_ids"), b.i64(k_dim)], "row_offs")
        flat_idx = b.op("Add", [ch, b.op("Unsqueeze", [offs, b.i64([1])], "row_offs_col")], "flat_idx")
        g = b.op("Gather", [b.op("Reshape", [r, b.i64([-1])], "r_flat"), flat_idx], "r_gathered", axis=0)
    else:
        g = b.op("Gather", [r, ch], "r_gathered", axis=1)
    if kp != k:
        g = b.op("Pad", [g, b.i64([0, 0, 0, kp - k])], "r_gathered_pad", mode="constant")
    comp, s_dec_r = nvfp4_activation_operand(b, g, kp, elem_type=F, per_token=per_token)
    if not per_row:
        return RACValues(b_x, s_dec_x, comp, s_dec_r, ch, kp)
    # per-token gathered: scatter the k real columns of each row back to dense [M, K] (disjoint per row)
    zeros = b.op("Abs", [b.op("Mul", [r, b.f32(0.0)], "dense_zeros_s")], "dense_zeros")
    real = b.op("Slice", [comp, b.i64([0]), b.i64([k]), b.i64([1])], "comp_real")
    return RACValues(b_x, s_dec_x, b.op("ScatterElements", [zeros, ch, real], "comp_dense", axis=1), s_dec_r, None, 0)
