"""ONNX emitters: qpass's reference arithmetic written as ONNX nodes, op for op.

Two kinds of emitter, both flavour-aware (``spec`` / ``portable``, see :mod:`.builder`):

* **weight decoders** ``(builder, q, name, dtype) -> value``: put the quantized bytes in
  initializers and decode them exactly as :mod:`qpass.quant` dequantizes;
* **activation fake-quant** ``(builder, x, k, dtype, ...) -> value``: a dynamic quantize-dequantize
  subgraph equal to ``qpass.tables.reference_qdq`` bit for bit.

Arithmetic (every node is one IEEE float32 operation with round-to-nearest-even; ONNX has no FMA
contraction between nodes):

NVFP4 (SPEC §3)::

    amax  = ReduceMax(|x|)                      per tensor, or per row (per_token)
    S_enc = Where(amax==0 | S_enc==0, 1, Min(Div(2688, amax), FLT_MAX))
    S_dec = Div(1, S_enc)                       a division, never Reciprocal
    mult  = Mul(S_enc, fl(1/6))                 fl(1/6) = 0x3E2AAAAB
    s_b   = Cast(Cast(Min(Mul(vmax, mult), 448), FLOAT8E4M3FN), FLOAT)   RNE, subnormals kept
    enc   = Min(Div(1, Mul(s_b, S_dec)), FLT_MAX)
    y     = Clip(Mul(x, enc), -6, 6)
    code  = E2M1 RNE of y                       spec: Cast(FLOAT4E2M1); portable: 7 exact threshold
                                                 comparisons (qpass.formats.e2m1.e2m1_encode) + LUT
    x_hat = Cast(Mul(Mul(e2m1(code), s_b), S_dec), dtype)

The weight decode is the last line with stored bytes: ``fl(fl(e2m1 * s_b) * S_dec)``. This is
**not** the ModelOpt/TensorRT "double DequantizeLinear" order ``fl(e2m1 * fl(s_b * S_dec))``: that
rounds twice and differs from SPEC §3 in about 9 % of float32 elements and, after the bf16
rounding, in about 6e-6 of (code, scale, global) combinations (e.g. amax 0.66688365,
s_b = 0.017578125, code 1.5). :func:`nvfp4_weight` emits our order by default and the ModelOpt
order only on request (``pattern='double_dq'``).

FP8 E4M3 (SPEC §3 last paragraph): ``scale = Div(amax, 448)`` (0 -> ``zero_amax_scale``),
``inv = Min(Div(1, scale), FLT_MAX)``, ``e = Cast(Mul(x, inv), FLOAT8E4M3FN)`` (saturating RNE),
``x_hat = DequantizeLinear(e, scale)`` = ``fl(float(e) * scale)``.

MXFP4 (OCP MX v1.0): ``fl(e2m1 * 2^(s - 127))`` (exact), scale byte 0xFF decodes to NaN.

Signed zeros follow the reference too: an exact ``-0.0`` before E2M1/E4M3 rounding becomes code
``+0`` (qpass encodes the sign only for ``y < 0``), a tiny negative value becomes ``-0``.
Non-finite activations (which qpass refuses with an error) cannot raise inside an ONNX graph;
the activation subgraphs instead turn the whole output (the row, for per-token scales) into NaN, so
they never produce a silent code.
"""

from __future__ import annotations

import math

import torch
from onnx import TensorProto

from qpass.errors import QuantizationError
from qpass.formats.e2m1 import E2M1_MIDPOINTS, E2M1_VALUES, _TIE_GOES_UP_RNE
from qpass.formats.fp32 import FP8_E4M3_MAX, NVFP4_GLOBAL_NUMERATOR
from qpass.formats.spec import FP8Spec, Granularity
from qpass.quant.fp8 import FP8Tensor
from qpass.quant.mxfp4 import MXFP4Tensor
from qpass.quant.nvfp4 import NVFP4Tensor

from qpass.backends.onnx.builder import FLT_MAX, GraphBuilder

F = TensorProto.FLOAT
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
ONE_SIXTH = 1.0 / 6.0  # rounded once to float32 by GraphBuilder.f32: 0x3E2AAAAB
E2M1_LUT16 = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]  # code -> value; code 8 is -0.0
E8M0_LUT256 = [math.ldexp(1.0, b - 127) for b in range(255)] + [float("nan")]

OPSET_FP4 = 23  # DequantizeLinear / Cast accept FLOAT4E2M1
OPSET_E8M0 = 24  # DequantizeLinear accepts FLOAT8E8M0 scales


# ---------------------------------------------------------------------------------------- helpers
def to_float(b: GraphBuilder, x: str, elem_type: int) -> str:
    """``x`` as float32 (exact for bf16/fp16 inputs; no node if already float32)."""
    return x if elem_type == F else b.op("Cast", [x], "x_f32", to=F)


def round_to(b: GraphBuilder, x32: str, dtype: int) -> str:
    """Round a float32 value to ``dtype`` (RNE); float32 passes through."""
    return x32 if dtype == F else b.op("Cast", [x32], "rounded", to=dtype)


def _plus_zero(b: GraphBuilder, y: str) -> str:
    """``-0.0 -> +0.0``, every other value unchanged (qpass codes carry a sign only for y < 0)."""
    zero = b.f32(0.0)
    return b.op("Where", [b.op("Equal", [y, zero]), zero, y], "y_nz")


def _poison(b: GraphBuilder, xs: str, out32: str, axes: list[int] | None) -> str:
    """NaN wherever the reduction group of ``xs`` holds NaN/inf (``sum(x * 0)`` is 0 iff all finite)."""
    z = b.op("Mul", [xs, b.f32(0.0)], "x_times_0")
    if axes is None:
        s = b.op("ReduceSum", [z], "finite_probe", keepdims=0)
    else:
        s = b.op("ReduceSum", [z, b.i64(axes)], "finite_probe", keepdims=1)
    return b.op("Where", [b.op("Equal", [s, b.f32(0.0)]), out32, b.f32(float("nan"))], "guarded")


def unpack_nibbles(b: GraphBuilder, packed: str, rows: int, k: int) -> str:
    """uint8 ``[rows, k/2]`` -> int64 codes ``[rows, k]`` (low nibble = even k), opset-21 ops only."""
    lo = b.op("BitwiseAnd", [packed, b.u8(0x0F)], "lo")
    hi = b.op("BitShift", [packed, b.u8(4)], "hi", direction="RIGHT")
    ax = b.i64([-1])
    pair = b.op("Concat", [b.op("Unsqueeze", [lo, ax]), b.op("Unsqueeze", [hi, ax])], "pairs", axis=-1)
    codes = b.op("Reshape", [pair, b.i64([rows, k])], "codes_u8")
    return b.op("Cast", [codes], "codes", to=TensorProto.INT64)


def e2m1_lut_decode(b: GraphBuilder, codes_i64: str) -> str:
    """Signed E2M1 values (float32) of int64 codes 0..15 via a 16-entry table."""
    return b.op("Gather", [b.table(E2M1_LUT16, "e2m1_lut"), codes_i64], "e2m1_vals", axis=0)


def e2m1_round_portable(b: GraphBuilder, y: str) -> str:
    """Signed E2M1 value (float32) nearest to ``y`` (|y| <= 6), ties to even: a port of
    :func:`qpass.formats.e2m1.e2m1_encode` (magnitude index = number of midpoints below |y|,
    ``>=`` where the tie goes up, ``>`` where it goes down; sign bit 8 for ``y < 0``), decoded with
    the 16-entry table. The sign goes through the code, not ``Neg``: onnxruntime's ``Neg(0.0)``
    returns ``+0.0`` where the reference decodes code 8 to ``-0.0``."""
    a = b.op("Abs", [y], "y_abs")
    code = b.op("Mul", [b.op("Cast", [b.op("Less", [y, b.f32(0.0)], "neg")], "neg_f", to=F), b.f32(8.0)], "sign_code")
    for mid, up in zip(E2M1_MIDPOINTS, _TIE_GOES_UP_RNE):
        hit = b.op("GreaterOrEqual" if up else "Greater", [a, b.f32(mid)], "hit")
        code = b.op("Add", [code, b.op("Cast", [hit], "hit_f", to=F)], "code_f")
    return e2m1_lut_decode(b, b.op("Cast", [code], "code", to=TensorProto.INT64))


def e4m3_round_to_float(b: GraphBuilder, v: str) -> str:
    """E4M3 RNE-satfinite value (float32) of float32 ``v``: Cast to FLOAT8E4M3FN and back."""
    return b.op("Cast", [b.op("Cast", [v], "e4m3", to=TensorProto.FLOAT8E4M3FN, saturate=1)], "e4m3_f", to=F)


# ---------------------------------------------------------------------------------------- NVFP4
def nvfp4_global_scales(b: GraphBuilder, amax: str) -> tuple[str, str]:
    """``(S_enc, S_dec)`` from float32 ``amax`` (:func:`qpass.quant.nvfp4.global_scales`)."""
    s_enc = b.op("Min", [b.op("Div", [b.f32(NVFP4_GLOBAL_NUMERATOR), amax], "s_enc_raw"), b.f32(FLT_MAX)], "s_enc_clamped")
    zero = b.f32(0.0)
    bad = b.op("Or", [b.op("Equal", [amax, zero]), b.op("Equal", [s_enc, zero])], "s_enc_bad")
    s_enc = b.op("Where", [bad, b.f32(1.0), s_enc], "s_enc")
    s_dec = b.op("Div", [b.f32(1.0), s_enc], "s_dec")
    return s_enc, s_dec


def _nvfp4_activation_parts(b: GraphBuilder, x: str, k: int, *, elem_type: int, per_token: bool) -> tuple[str, str, str]:
    """``(v_sb, s_dec, x_blocks)``: the blocks ``[M, nb, 16]`` of ``B = fl(e2m1 * s_b)`` (exact), the
    decode global scale (float32 scalar, or ``[M, 1, 1]`` per token) and the input blocks."""
    if k % NVFP4_BLOCK:
        raise QuantizationError(f"NVFP4 activation fake-quant needs K % 16 == 0, got K={k} (ONNX input {x})")
    xf = to_float(b, x, elem_type)
    xb = b.op("Reshape", [xf, b.i64([-1, k // NVFP4_BLOCK, NVFP4_BLOCK])], "x_blocks")
    vmax = b.op("ReduceMax", [b.op("Abs", [xb], "x_abs"), b.i64([-1])], "vmax", keepdims=1)  # [M, nb, 1]
    if per_token:
        amax = b.op("ReduceMax", [vmax, b.i64([1])], "amax", keepdims=1)  # [M, 1, 1]
    else:
        amax = b.op("ReduceMax", [vmax], "amax", keepdims=0)  # scalar
    s_enc, s_dec = nvfp4_global_scales(b, amax)
    mult = b.op("Mul", [s_enc, b.f32(ONE_SIXTH)], "mult")
    sf = b.op("Min", [b.op("Mul", [vmax, mult], "sf_raw"), b.f32(FP8_E4M3_MAX)], "sf")
    s_b = e4m3_round_to_float(b, sf)  # [M, nb, 1]
    enc = b.op("Min", [b.op("Div", [b.f32(1.0), b.op("Mul", [s_b, s_dec], "sb_sdec")], "enc_raw"), b.f32(FLT_MAX)], "enc")
    y = b.op("Clip", [b.op("Mul", [xb, enc], "x_enc"), b.f32(-6.0), b.f32(6.0)], "y")
    if b.flavour == "spec":
        b.need_opset(OPSET_FP4)
        q = b.op("Cast", [_plus_zero(b, y)], "q_fp4", to=TensorProto.FLOAT4E2M1)
        vs = b.op("DequantizeLinear", [q, s_b], "v_sb", axis=2, block_size=NVFP4_BLOCK)  # fl(e2m1 * s_b), exact
    else:
        vs = b.op("Mul", [e2m1_round_portable(b, y), s_b], "v_sb")
    return vs, s_dec, xb


def nvfp4_activation(b: GraphBuilder, x: str, k: int, *, elem_type: int, dtype: int, per_token: bool,
                     operand_limit: float | None = None) -> str:
    """NVFP4 dynamic fake-quant of ``x`` ``[..., k]`` (any rank >= 1); returns the dense ``x_hat`` of
    ``x``'s shape (a dense tensor: ``qpass::nvfp4_act_qdq``, RAC's residual; the W4A4 GEMM multiplies
    :func:`nvfp4_activation_operand` instead).

    Args:
        x: input value name, element type ``elem_type`` (float/bf16/fp16).
        k: static size of the last dim, a multiple of 16.
        dtype: element type of the result (bf16 reproduces the rollout linear's ``DQ(Q_A(x))``,
            the input type reproduces ``reference_qdq``).
        per_token: one global scale per row (all leading dims flattened) instead of per tensor.
        operand_limit: the bound of the dense activation (``qpass.quant.nvfp4.act_operand_limit`` of
            the activation dtype): ``Clip`` to it before the rounding (``nvfp4_act_operand``, the
            residual's ``DQ(Q_A(X))``); None: no clip (``reference_qdq``).
    Raises:
        QuantizationError: ``k`` is not a multiple of 16.
    Source: SPEC §3 / :func:`qpass.quant.nvfp4.quantize_with_amax`.
    """
    vs, s_dec, xb = _nvfp4_activation_parts(b, x, k, elem_type=elem_type, per_token=per_token)
    out = b.op("Mul", [vs, s_dec], "x_hat_blocks")
    out = _poison(b, xb, out, [1, 2] if per_token else None)
    out = b.op("Reshape", [out, b.op("Shape", [x], "x_shape")], "x_hat_f32")
    if operand_limit is not None:
        out = b.op("Clip", [out, b.f32(-operand_limit), b.f32(operand_limit)], "x_hat_sat")
    return round_to(b, out, dtype)


def nvfp4_activation_operand(b: GraphBuilder, x: str, k: int, *, elem_type: int, per_token: bool) -> tuple[str, str]:
    """The W4A4 GEMM operand of a dynamic NVFP4 activation ``x`` ``[M, k]`` (SPEC §3.1):
    ``(B_X, S_dec_X)`` with ``B_X = e2m1 * s_b`` float32 ``[M, k]`` (exact; NaN rows/tensor where
    the input is not finite) and ``S_dec_X`` float32 (scalar, or ``[M, 1]`` per token), which the
    caller multiplies into the GEMM's output (``alpha``)."""
    vs, s_dec, xb = _nvfp4_activation_parts(b, x, k, elem_type=elem_type, per_token=per_token)
    vs = _poison(b, xb, vs, [1, 2] if per_token else None)
    bx = b.op("Reshape", [vs, b.op("Shape", [x], "x_shape")], "b_x")
    if per_token:
        s_dec = b.op("Reshape", [s_dec, b.i64([-1, 1])], "s_dec_rows")
    return bx, s_dec


def nvfp4_weight_operand(b: GraphBuilder, q: NVFP4Tensor, name: str) -> tuple[str, str]:
    """The NVFP4 weight ``[N, K]`` as the factored GEMM's operand (SPEC §3.1): ``(B_W, S_dec_W)`` with
    ``B_W = e2m1 * s_b`` float32 ``[N, K]`` (spec flavour: a ``DequantizeLinear`` of the FP4 codes
    with the block scales, exact) and the float32 scalar initializer ``S_dec_W`` the caller multiplies
    into the GEMM's output.

    Initializers (names ``<name>.weight`` ...): spec flavour ``FLOAT4E2M1 [N, K]`` (the packed
    bytes), ``FLOAT8E4M3FN [N, K/16]`` block scales, float32 scalar ``S_dec``; portable flavour the
    same bytes as ``UINT8 [N, K/2]`` and ``FLOAT8E4M3FN [N, K/16]``.

    Raises:
        QuantizationError: not a 2-D weight, or a per-token global scale.
    """
    n, k = q.shape[-2], q.shape[-1]
    if len(q.shape) != 2 or q.s_dec.numel() != 1:
        raise QuantizationError(f"ONNX NVFP4 weight {name}: need a 2-D weight with one global scale, got shape {tuple(q.shape)}, s_dec {tuple(q.s_dec.shape)}")
    scales = b.raw(q.scales.view(torch.uint8), TensorProto.FLOAT8E4M3FN, [n, k // NVFP4_BLOCK], f"{name}.weight_scale")
    s_dec = b.raw(q.s_dec.reshape(()).float(), F, [], f"{name}.weight_scale_2")
    if b.flavour == "spec":
        b.need_opset(OPSET_FP4)
        codes = b.raw(q.codes, TensorProto.FLOAT4E2M1, [n, k], f"{name}.weight")
        s_b = b.op("DequantizeLinear", [scales, b.f32(1.0)], f"{name}.s_b")  # exact e4m3 -> float32
        vs = b.op("DequantizeLinear", [codes, s_b], f"{name}.b_w", axis=1, block_size=NVFP4_BLOCK)
    else:
        codes = b.raw(q.codes, TensorProto.UINT8, [n, k // 2], f"{name}.weight")
        vals = e2m1_lut_decode(b, unpack_nibbles(b, codes, n, k))
        s_b = b.op("Cast", [scales], f"{name}.s_b", to=F)
        vb = b.op("Reshape", [vals, b.i64([n, k // NVFP4_BLOCK, NVFP4_BLOCK])], f"{name}.v_blocks")
        vs = b.op("Mul", [vb, b.op("Unsqueeze", [s_b, b.i64([-1])], f"{name}.s_b3")], f"{name}.v_sb3")
        vs = b.op("Reshape", [vs, b.i64([n, k])], f"{name}.b_w")
    return vs, s_dec


def nvfp4_weight(b: GraphBuilder, q: NVFP4Tensor, name: str, *, dtype: int, pattern: str = "qpass") -> str:
    """Decode an NVFP4 weight ``[N, K]`` stored as initializers to the dense ``W_hat`` (``dtype``):
    ``fl(B_W * S_dec_W)`` (SPEC §3 dequant; a dense tensor, named so: the rollout linear's ONNX graph
    multiplies :func:`nvfp4_weight_operand` instead and scales its output).

    Args:
        pattern: ``qpass`` (default, SPEC §3 order, bit-exact) or ``double_dq`` (spec flavour only:
            ``DQ(codes, DQ(scales, S_dec))`` as ModelOpt/TensorRT emit it; not bit-exact, see module
            docstring).
    Raises:
        QuantizationError: not a 2-D weight, or a per-token global scale.
    """
    if pattern not in ("qpass", "double_dq"):
        raise ValueError(f"NVFP4 weight pattern must be 'qpass' or 'double_dq', got {pattern!r}")
    if pattern == "double_dq":
        if b.flavour != "spec":
            raise ValueError("the double_dq pattern needs FLOAT4E2M1 (spec flavour)")
        n, k = q.shape[-2], q.shape[-1]
        if len(q.shape) != 2 or q.s_dec.numel() != 1:
            raise QuantizationError(f"ONNX NVFP4 weight {name}: need a 2-D weight with one global scale, got shape {tuple(q.shape)}, s_dec {tuple(q.s_dec.shape)}")
        b.need_opset(OPSET_FP4)
        scales = b.raw(q.scales.view(torch.uint8), TensorProto.FLOAT8E4M3FN, [n, k // NVFP4_BLOCK], f"{name}.weight_scale")
        s_dec = b.raw(q.s_dec.reshape(()).float(), F, [], f"{name}.weight_scale_2")
        codes = b.raw(q.codes, TensorProto.FLOAT4E2M1, [n, k], f"{name}.weight")
        sf = b.op("DequantizeLinear", [scales, s_dec], f"{name}.scale_times_global")
        return round_to(b, b.op("DequantizeLinear", [codes, sf], f"{name}.w_f32", axis=1, block_size=NVFP4_BLOCK), dtype)
    vs, s_dec = nvfp4_weight_operand(b, q, name)
    return round_to(b, b.op("Mul", [vs, s_dec], f"{name}.w_f32"), dtype)


# ---------------------------------------------------------------------------------------- MXFP4
def mxfp4_weight(b: GraphBuilder, q: MXFP4Tensor, name: str, *, dtype: int) -> str:
    """Decode an MXFP4 weight ``[N, K]``: spec flavour ``DQ(FLOAT4E2M1, FLOAT8E8M0, block 32)`` at
    opset 24; portable flavour nibble unpack + E2M1 table and a 256-entry E8M0 table."""
    n, k = q.shape[-2], q.shape[-1]
    if len(q.shape) != 2:
        raise QuantizationError(f"ONNX MXFP4 weight {name}: need a 2-D weight, got shape {tuple(q.shape)}")
    if b.flavour == "spec":
        b.need_opset(OPSET_E8M0)
        codes = b.raw(q.codes, TensorProto.FLOAT4E2M1, [n, k], f"{name}.weight")
        scales = b.raw(q.scales, TensorProto.FLOAT8E8M0, [n, k // MXFP4_BLOCK], f"{name}.weight_scale")
        w = b.op("DequantizeLinear", [codes, scales], f"{name}.w_f32", axis=1, block_size=MXFP4_BLOCK, output_dtype=F)
        return round_to(b, w, dtype)
    codes = b.raw(q.codes, TensorProto.UINT8, [n, k // 2], f"{name}.weight")
    scales = b.raw(q.scales, TensorProto.UINT8, [n, k // MXFP4_BLOCK], f"{name}.weight_scale")
    vals = e2m1_lut_decode(b, unpack_nibbles(b, codes, n, k))
    s = b.op("Gather", [b.table(E8M0_LUT256, "e8m0_lut"), b.op("Cast", [scales], f"{name}.s_idx", to=TensorProto.INT64)], f"{name}.s", axis=0)
    vb = b.op("Reshape", [vals, b.i64([n, k // MXFP4_BLOCK, MXFP4_BLOCK])], f"{name}.v_blocks")
    w = b.op("Mul", [vb, b.op("Unsqueeze", [s, b.i64([-1])], f"{name}.s3")], f"{name}.w3")
    return round_to(b, b.op("Reshape", [w, b.i64([n, k])], f"{name}.w_f32"), dtype)


# ---------------------------------------------------------------------------------------- FP8
def fp8_weight(b: GraphBuilder, q: FP8Tensor, name: str, *, dtype: int) -> str:
    """Decode an FP8 E4M3 weight ``[N, K]``: ``DequantizeLinear(FLOAT8E4M3FN, fp32 scale)``.

    Per-tensor: one scalar scale. 128x128 blocks: the stored ``[ceil(N/128), ceil(K/128)]``
    decode multipliers are repeated along N in the graph (Expand/Reshape/Slice: data movement
    only) and applied with a blocked DequantizeLinear along K (a partial last block is allowed).
    Both flavours (fp8 DequantizeLinear is opset 19/21 and runs in onnxruntime).
    """
    spec = q.spec
    if len(q.shape) != 2:
        raise QuantizationError(f"ONNX FP8 weight {name}: need a 2-D weight, got shape {tuple(q.shape)}")
    n, k = q.shape
    data = b.raw(q.data.view(torch.uint8), TensorProto.FLOAT8E4M3FN, [n, k], f"{name}.weight")
    if spec.granularity == Granularity.PER_TENSOR:
        scale = b.raw(q.scale.reshape(()).float(), F, [], f"{name}.weight_scale_inv")
        return round_to(b, b.op("DequantizeLinear", [data, scale], f"{name}.w_f32"), dtype)
    if spec.granularity != Granularity.BLOCK_128X128:
        raise QuantizationError(f"ONNX FP8 weight {name}: granularity {spec.granularity.value} is not a weight granularity")
    br, bc = spec.block_shape
    nbr, nbc = q.scale.shape
    scale = b.raw(q.scale.float(), F, [nbr, nbc], f"{name}.weight_scale_inv")
    rep = b.op("Expand", [b.op("Unsqueeze", [scale, b.i64([1])], f"{name}.s3"), b.i64([nbr, br, nbc])], f"{name}.s_rep")
    rows = b.op("Reshape", [rep, b.i64([nbr * br, nbc])], f"{name}.s_rows")
    rows = b.op("Slice", [rows, b.i64([0]), b.i64([n]), b.i64([0])], f"{name}.s_n")
    return round_to(b, b.op("DequantizeLinear", [data, rows], f"{name}.w_f32", axis=1, block_size=bc), dtype)


def fp8_activation(b: GraphBuilder, x: str, k: int, *, elem_type: int, dtype: int, spec: FP8Spec) -> str:
    """FP8 E4M3 dynamic fake-quant of ``x`` ``[..., k]``; returns ``x_hat`` of ``x``'s shape.

    Granularities: ``per_token`` (one scale per row), ``block_1x128`` (zero-padded to whole blocks
    for the amax; padding never changes a max of |x|), ``per_tensor``. Source:
    :func:`qpass.quant.fp8.fp8_quantize`.
    """
    g = spec.granularity
    xf = to_float(b, x, elem_type)
    x2 = b.op("Reshape", [xf, b.i64([-1, k])], "x2")
    if g == Granularity.PER_TENSOR:
        xs, bs, kp, axes = x2, None, k, None
        amax = b.op("ReduceMax", [b.op("Abs", [x2])], "amax", keepdims=0)
    else:
        bs = k if g == Granularity.PER_TOKEN else spec.block_shape[1]
        if g not in (Granularity.PER_TOKEN, Granularity.BLOCK_1X128):
            raise QuantizationError(f"FP8 activation granularity {g.value} is not supported (ONNX input {x})")
        kp = -(-k // bs) * bs
        xp = x2 if kp == k else b.op("Pad", [x2, b.i64([0, 0, 0, kp - k])], "x_pad", mode="constant")
        xs = b.op("Reshape", [xp, b.i64([-1, kp // bs, bs])], "x_blocks")
        amax = b.op("ReduceMax", [b.op("Abs", [xs]), b.i64([-1])], "amax", keepdims=1)  # [M, nb, 1]
        axes = [1, 2]
    scale = b.op("Div", [amax, b.f32(FP8_E4M3_MAX)], "scale_raw")
    scale = b.op("Where", [b.op("Equal", [scale, b.f32(0.0)]), b.f32(spec.zero_amax_scale), scale], "scale")
    inv = b.op("Min", [b.op("Div", [b.f32(1.0), scale], "inv_raw"), b.f32(FLT_MAX)], "inv")
    e = b.op("Cast", [_plus_zero(b, b.op("Mul", [xs, inv], "x_inv"))], "x_e4m3", to=TensorProto.FLOAT8E4M3FN, saturate=1)
    if bs is None:
        out = b.op("DequantizeLinear", [e, scale], "x_hat_blocks")
    else:
        out = b.op("DequantizeLinear", [e, scale], "x_hat_blocks", axis=2, block_size=bs)
    out = _poison(b, xs, out, axes)
    if bs is not None:
        out = b.op("Reshape", [out, b.i64([-1, kp])], "x_hat_pad")
        if kp != k:
            out = b.op("Slice", [out, b.i64([0]), b.i64([k]), b.i64([1])], "x_hat_2d")
    out = b.op("Reshape", [out, b.op("Shape", [x], "x_shape")], "x_hat_f32")
    return round_to(b, out, dtype)
