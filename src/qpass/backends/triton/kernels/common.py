"""Bit-exact numeric building blocks shared by every qpass Triton kernel (``@triton.jit`` helpers).

Each helper is a port of a reference function in :mod:`qpass.formats` / :mod:`qpass.quant`; the
comment on each names it. All arithmetic is IEEE float32 with one rounding per operation: division
is ``tl.div_rn`` (Triton's ``/`` on floats is an approximate reciprocal on NVIDIA), and every kernel
that uses these helpers is launched with ``enable_fp_fusion=False`` so no multiply-add is contracted.

Kernels in this package use only Triton *builtins* plus the reducers below, never the
``triton.language.standard`` helpers (``tl.max``, ``tl.sum``, ``tl.zeros``...): those are
``@jit`` functions built once, in whichever mode ``triton`` itself was first imported, and would
break the other mode's copy of this package. ``tl.reduce`` with the standard combine functions
works in both modes (the interpreter recognises them and reduces with numpy).

``INTERP`` is fixed when this package copy is imported (see ``qpass.backends.triton._loader``): the
Triton 3.6 CPU interpreter truncates float32 -> bfloat16 casts and multiplies bfloat16 operands of
``tl.dot`` as raw 16-bit integers, so under the interpreter ``to_bf16`` rounds with integer bit
operations and ``dot_acc`` multiplies exact float32 copies instead.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERP = tl.constexpr(bool(knobs.runtime.interpret))

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # 0x7F7FFFFF
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fl(1/6) = 0x3E2AAAAB, exactly
NVFP4_NUMER = tl.constexpr(2688.0)  # 448 * 6
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def ub(n):
    """A runtime loop bound usable in ``range``.

    Triton 3.6's interpreter turns scalar arguments into 1-element numpy arrays, which numpy >= 2
    refuses to convert with ``int()``; under the interpreter this returns a Python int instead.
    """
    if INTERP:
        return n.handle.data.item() if hasattr(n, "handle") else n
    else:
        return n


@triton.jit
def rmax(x, axis: tl.constexpr):
    """Max-reduce along ``axis`` (ints or floats; exact)."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def rmin(x, axis: tl.constexpr):
    """Min-reduce along ``axis``."""
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def rsum(x, axis: tl.constexpr):
    """Sum-reduce along ``axis`` in ``x.dtype`` (use on integers where order must not matter)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def bf16_rne_f32(f):
    """float32 -> the float32 value of its bfloat16 round-to-nearest-even (finite input)."""
    b = f.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return r.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(f):
    """float32 -> bfloat16 with round-to-nearest-even on every backend (see module docstring)."""
    if INTERP:
        return bf16_rne_f32(f).to(tl.bfloat16)
    else:
        return f.to(tl.bfloat16)


# bf16 max (0x7F7F): the default bound of the W4A4 activation operand (bf16/fp32 activations)
BF16_MAX = 3.3895313892515355e38


@triton.jit
def act_operand_bf16(xh, lim):
    """W4A4 activation operand: bf16 RNE of the float32 decode ``xh`` saturated to ``[-lim, lim]``
    (``lim`` a bf16 value: ``qpass.quant.nvfp4.act_operand_limit`` of the activation dtype, 65280
    for fp16); equals ``qpass.quant.nvfp4.nvfp4_act_operand``."""
    return to_bf16(tl.minimum(tl.maximum(xh, -lim), lim))


@triton.jit
def to_out(f, DTYPE: tl.constexpr):
    """float32 accumulator -> output dtype (one RNE rounding)."""
    if DTYPE == tl.bfloat16:
        return to_bf16(f)
    else:
        return f.to(DTYPE)


@triton.jit
def dot_acc(a, b, acc):
    """``acc + a @ b`` with float32 accumulation.

    bf16 x bf16 uses the tensor cores (products of bf16 are exact in float32); float32 operands use
    IEEE float32 FMA (``input_precision='ieee'``, never TF32). Under the interpreter bf16 operands
    are upcast first (exact) because the interpreter does not multiply bf16 as floats.
    """
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)


@triton.jit
def add_rn(a, b):
    """float32 ``a + b`` (round to nearest) as a separate add.

    Promotes a tensor-core partial sum into the outer float32 accumulator. On the GPU it is an
    inline ``add.rn.f32``: Triton's combiner rewrites a plain ``acc + dot(a, b, 0)`` into
    ``dot(a, b, acc)``, which would put the sum back inside the tensor core (checked in the sm_90
    SASS by ``qpass.apps.bench.aot``).
    """
    if INTERP:
        return a + b
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def e4m3_round_mag(a):
    """Port of ``qpass.formats.e4m3.e4m3_round_magnitude``: float32 ``a >= 0`` -> nearest E4M3 value.

    RNE, subnormals kept, saturating at 448. Normal range: round the bit pattern to 3 mantissa bits;
    subnormal range: ``fl(a*2^9 + 2^23) - 2^23`` rounds ``a*2^9`` to an integer (one RNE rounding).
    """
    a = tl.minimum(a, E4M3_MAX)
    b = a.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
    scaled = a * 512.0
    sub = ((scaled + 8388608.0) - 8388608.0) * 0.001953125  # 2^23, 2^-9 (exact)
    return tl.where(a >= 0.015625, normal, sub)


@triton.jit
def e4m3_byte(v):
    """E4M3 byte (int32 0..0xFE) of a float32 value already on the E4M3 grid (sign kept, -0 -> 0x80)."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((((ab >> 23) & 0xFF) - 120) << 3) | ((ab >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)
    return tl.where(a >= 0.015625, normal, sub) | sign


@triton.jit
def e4m3_value(byte):
    """float32 value of E4M3 bytes (int32 0..255, 0x7F/0xFF NaN never occur in qpass data)."""
    sign = (byte & 0x80) << 24
    e = (byte >> 3) & 0xF
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    mag = tl.where(e > 0, normal, sub)
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_index(a):
    """Port of ``qpass.formats.e2m1.e2m1_encode`` (nearest-even): magnitude index 0..7 of ``a = |y| <= 6``."""
    idx = (a > 0.25).to(tl.int32)
    idx += (a >= 0.75).to(tl.int32)
    idx += (a > 1.25).to(tl.int32)
    idx += (a >= 1.75).to(tl.int32)
    idx += (a > 2.5).to(tl.int32)
    idx += (a >= 3.5).to(tl.int32)
    idx += (a > 5.0).to(tl.int32)
    return idx


@triton.jit
def e2m1_value(code):
    """float32 value of E2M1 codes (int32 0..15; bit 3 = sign, code 8 = -0.0).

    Magnitude index m: 0 -> 0, 1 -> 0.5, m >= 2 -> bits ``(m + 252) << 22`` (1, 1.5, 2, 3, 4, 6).
    """
    m = code & 7
    mag = tl.where(m <= 1, m * 0x3F000000, (m + 252) << 22)
    return (mag | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def nvfp4_global(amax):
    """Port of ``qpass.quant.nvfp4.global_scales`` plus the block multiplier.

    Returns ``(s_enc, s_dec, mult)``: ``s_enc = min(fl(2688/amax), FLT_MAX)`` (1 where amax == 0 or
    s_enc == 0), ``s_dec = fl(1/s_enc)``, ``mult = fl(s_enc * fl(1/6))``. ``amax`` float32 (any shape).
    """
    numer = tl.full(amax.shape, NVFP4_NUMER, tl.float32)
    one = tl.full(amax.shape, 1.0, tl.float32)
    safe = tl.where(amax == 0.0, numer, amax)  # 2688/0 = inf would be replaced by 1 below anyway
    s_enc = tl.minimum(tl.div_rn(numer, safe), FLT_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), one, s_enc)
    s_dec = tl.div_rn(one, s_enc)
    mult = s_enc * ONE_SIXTH
    return s_enc, s_dec, mult


@triton.jit
def nvfp4_block_scale(vmax, mult):
    """``s_b = e4m3_rne_satfinite(min(fl(vmax * mult), 448))`` (float32 value on the E4M3 grid)."""
    return e4m3_round_mag(tl.minimum(vmax * mult, FLT_MAX))


@triton.jit
def nvfp4_elem_mult(s_b, s_dec):
    """``enc = min(fl(1 / fl(s_b * s_dec)), FLT_MAX)``; a zero block scale gives FLT_MAX."""
    denom = s_b * s_dec
    one = tl.full(denom.shape, 1.0, tl.float32)
    enc = tl.minimum(tl.div_rn(one, tl.where(denom == 0.0, one, denom)), FLT_MAX)
    return tl.where(denom == 0.0, FLT_MAX, enc)  # fl(1/0) = inf -> FLT_MAX


@triton.jit
def nvfp4_encode(x, enc):
    """E2M1 codes (int32 0..15) of ``clamp(fl(x * enc), -6, 6)``; ``x``, ``enc`` float32 (broadcast)."""
    y = tl.minimum(tl.maximum(x * enc, -6.0), 6.0)
    return e2m1_index(tl.abs(y)) | ((y < 0.0).to(tl.int32) << 3)


@triton.jit
def nvfp4_decode_f32(code, s_b, s_dec):
    """``fl(fl(e2m1(code) * s_b) * s_dec)`` in float32 (before the bf16 rounding)."""
    return (e2m1_value(code) * s_b) * s_dec


@triton.jit
def nvfp4_operand_f32(code, s_b):
    """``B = e2m1(code) * s_b`` in float32: the GEMM operand of SPEC §3.1 (exact: <= 6 significant bits)."""
    return e2m1_value(code) * s_b


@triton.jit
def row_alpha(s_ptr, rows, rmask, sdec_w, MODE: tl.constexpr):
    """The epilogue scale of SPEC §3.1 per output row ``[BM]`` float32: ``MODE`` 0 (W4A16)
    ``S_dec_W``; 1 ``fl(S_dec_X * S_dec_W)`` with one activation scale at ``s_ptr``; 2 the same per
    row (per-token activations, or one scale per expert segment) from ``s_ptr[rows]``."""
    if MODE == 2:
        return tl.load(s_ptr + rows, mask=rmask, other=0.0) * sdec_w
    elif MODE == 1:
        return tl.full(rows.shape, 0.0, tl.float32) + tl.load(s_ptr) * sdec_w
    else:
        return tl.full(rows.shape, 0.0, tl.float32) + sdec_w


@triton.jit
def frexp_exp(a):
    """``math.frexp(a)[1]`` for float32 ``a > 0`` (finite; subnormals normalised by an exact 2^64)."""
    sub = a < 1.1754943508222875e-38  # 2^-126
    an = tl.where(sub, tl.where(sub, a, 0.0) * 18446744073709551616.0, a)  # 2^64 (exact on subnormals)
    e = ((an.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    return tl.where(sub, e - 64, e)


@triton.jit
def pow2_f32(e):
    """float32 ``2^e`` for int32 ``-126 <= e <= 127`` (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pack_nibbles(codes, R: tl.constexpr, C: tl.constexpr):
    """int32 codes ``[R, C]`` (C even) -> uint8 bytes ``[R, C/2]`` with element 2j in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def load_tile_f32(x_ptr, stride_xm, rows, cols, M, K):
    """Load ``x[rows, cols]`` (row stride ``stride_xm``, unit column stride) as float32 ``[BM, BK]``,
    0 outside ``[M, K]``.

    Returns ``(x, rmask [BM], mask [BM, BK], rows64 [BM] int64)``: the row mask, the tile mask and the
    64-bit row ids every kernel's stores index with.
    """
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, rmask, mask, rows64

