"""NVFP4-weight GEMM with the factored decode (SPEC §3.1), float32 accumulation::

    y = fl(acc(A B_W^T) * alpha) (+ fl(acc(A2 B_W[:, cols]^T) * alpha_R)) (+ bias)

``B_W = e2m1 * s_b`` is decoded in registers from packed E2M1 codes ``[N, K/2]`` and E4M3 block-scale
bytes ``[N, K/16]`` (exact in bf16: no float multiply by the global scale per element) and multiplied
on the bf16 tensor cores (``tl.dot``, float32 accumulator). The per-tensor scales are applied once,
in the epilogue: ``alpha = S_dec_W`` (W4A16) or ``fl(S_dec_X * S_dec_W)`` (W4A4; per row for
per-token activations, ``xs``). The activation operand ``A`` is bf16 (W4A16 with bf16 input, or the
W4A4 operand ``B_X`` that the quantization kernel wrote), or float32 for fp16/fp32 W4A16 input
(exact products, IEEE float32 dot).

The optional second segment is RAC's compensation (``qpass.quant.linear``): ``SEG2 == 1`` a dense
``[M, K]`` operand ``B_R`` over the same weight (masked mode), ``SEG2 == 2`` a gathered ``[M, K']``
operand whose column ``t`` multiplies weight channel ``idx[t]`` (-1 = padding), decoded from the same
packed bytes. It has its own float32 accumulator and its own ``alpha_R = fl(S_dec_R * S_dec_W)``
(``rs``): two accumulations, no bf16 sum of the compensated activation.

Tiles are computed transposed (``acc[BN, BM] = W_tile @ A_tile^T``): the decoded weight is the MMA's
first operand and the (possibly tiny) token count the second, so decode (M = 1..16) still fills the
MMA's 64-row dimension. Split-K writes the raw float32 partials of each accumulation, which
``_splitk_reduce_kernel`` sums in a fixed order (deterministic; no float atomics) before it applies
``alpha`` once.

Accumulation (``PROMOTE_K``, :func:`default_accumulation`): by default no whole K sum stays in the
tensor core's accumulator, whose additions on sm_90 are not IEEE round-to-nearest (relative error
growing with K, 1.5e-5 - 3.2e-5 at K = 14336 on the H200). The tensor cores sum one K tile
(small-M kernel) or 1024 products (large-M kernel) from zero, and each partial is added to the
float32 accumulator with an IEEE ``add.rn.f32`` (``common.add_rn``): two-level accumulation as in
DeepSeek-V3's FP8 GEMMs ("promotion to CUDA cores"). ``PROMOTE_K = 0`` keeps the single-level sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERP, add_rn, dot_acc, e2m1_value, e4m3_value, row_alpha, to_bf16, to_out, ub

@triton.jit
def _decode_w_tile(codes3, s3, A_F32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """bytes ``[BN, BK/16, 8]`` + scale bytes ``[BN, BK/16, 1]`` -> the operand ``B = e2m1 * s_b``
    ``[BN, BK]`` (SPEC §3.1: exact in bf16 and float32; ``S_dec_W`` goes to the epilogue's alpha).

    Element ``16b + 2j`` is the low nibble of byte ``j`` of block ``b``, ``16b + 2j + 1`` the high
    nibble; ``join`` + ``reshape`` interleave them back into K order.
    """
    c = codes3.to(tl.int32)
    s = e4m3_value(s3.to(tl.int32))
    lo = e2m1_value(c & 15) * s
    hi = e2m1_value(c >> 4) * s
    if A_F32:
        lo = to_bf16(lo).to(tl.float32)
        hi = to_bf16(hi).to(tl.float32)
    else:
        lo = to_bf16(lo)
        hi = to_bf16(hi)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


# --- table decode (compiled GPU path only) -------------------------------------------------------
# Per 16-element block the 8 possible magnitudes bf16(fl(fl(v * s_b) * s_dec)), v in
# {0, .5, 1, 1.5, 2, 3, 4, 6}, are computed once (the reference's own two roundings) and packed as
# bf16 pairs into four registers T0..T3; each code byte then becomes its two bf16 values with byte
# permutes (PRMT) instead of per-element float arithmetic: ~5.5 instructions per element instead of
# ~12. Bit-identical to the reference decode (validated against it exhaustively in a PRMT model and
# on the GPU by ``selfcheck``); the interpreter always uses the arithmetic decode.
_LUT_TABLE_ASM = tl.constexpr("""
{
.reg .f32 z, p1, p3, p4, p5, p6, p7, q1, q2, q3, q4, q5, q6, q7;
mov.f32 z, 0f00000000;
mul.rn.f32 p1, $4, 0f3F000000;
mul.rn.f32 p3, $4, 0f3FC00000;
mul.rn.f32 p4, $4, 0f40000000;
mul.rn.f32 p5, $4, 0f40400000;
mul.rn.f32 p6, $4, 0f40800000;
mul.rn.f32 p7, $4, 0f40C00000;
mul.rn.f32 q1, p1, $5;
mul.rn.f32 q2, $4, $5;
mul.rn.f32 q3, p3, $5;
mul.rn.f32 q4, p4, $5;
mul.rn.f32 q5, p5, $5;
mul.rn.f32 q6, p6, $5;
mul.rn.f32 q7, p7, $5;
cvt.rn.bf16x2.f32 $0, q1, z;
cvt.rn.bf16x2.f32 $1, q3, q2;
cvt.rn.bf16x2.f32 $2, q5, q4;
cvt.rn.bf16x2.f32 $3, q7, q6;
}
""")


def _lut_decode_asm() -> str:
    lines = [
        "{",
        ".reg .b32 sh, w, x, sel, lo4, hi4, t, m, v, s, r, zero, smask;",
        "mov.b32 zero, 0;",
        "mov.b32 smask, 0x80008000;",
        "shr.u32 sh, $8, 4;",
    ]
    for j in range(4):
        lines += [
            f"prmt.b32 w, $8, sh, {hex(j | ((4 + j) << 4))};",  # byte0 = code byte j, byte1 = its high nibble
            "and.b32 x, w, 0x0303;",
            "mad.lo.u32 sel, x, 0x22, 0x1010;",  # byte-pair selector of both magnitudes (low 2 bits)
            "prmt.b32 lo4, $9, $10, sel;",  # entries 0..3
            "prmt.b32 hi4, $11, $12, sel;",  # entries 4..7
            "shl.b32 t, w, 5;",
            "prmt.b32 m, t, zero, 0x9988;",  # 0xFFFF where the magnitude's bit 2 is set
            "lop3.b32 v, hi4, lo4, m, 0xE4;",  # m ? hi4 : lo4
            "shl.b32 t, w, 4;",
            "prmt.b32 s, t, zero, 0x1000;",  # code sign bits -> bf16 sign bits 15 and 31
            "lop3.b32 r, v, s, smask, 0xF8;",  # v | (s & smask)
            f"mov.b32 {{${2 * j}, ${2 * j + 1}}}, r;",
        ]
    lines.append("}")
    return "\n".join(lines)


_LUT_DECODE_ASM = tl.constexpr(_lut_decode_asm())


@triton.jit
def _decode_w_tile_lut(words, s2, A_F32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """int32 code words ``[BN, BK/16, 2]`` + scale bytes ``[BN, BK/16]`` -> the operand ``B`` ``[BN, BK]``
    (the table's global-scale input is 1.0: its ``fl(fl(v * s_b) * 1)`` is the exact ``B``)."""
    sf = tl.expand_dims(e4m3_value(s2.to(tl.int32)), 2)
    t0, t1, t2, t3 = tl.inline_asm_elementwise(
        _LUT_TABLE_ASM, "=r,=r,=r,=r,f,f", [sf, tl.full(sf.shape, 1.0, tl.float32)],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
    )
    shp: tl.constexpr = (BN, BK // 16, 2)
    e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
        _LUT_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
        [words, tl.broadcast_to(t0, shp), tl.broadcast_to(t1, shp), tl.broadcast_to(t2, shp), tl.broadcast_to(t3, shp)],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
    )
    # e_k holds element k (0..7) of each 8-element word; nest the joins so that the flattened
    # minor index is 4a + 2b + c = k.
    g0 = tl.join(tl.join(e0, e4), tl.join(e2, e6))
    g1 = tl.join(tl.join(e1, e5), tl.join(e3, e7))
    w = tl.reshape(tl.join(g0, g1), (BN, BK))
    if A_F32:
        w = w.to(tl.float32)
    return w


@triton.jit
def _dense_step(acc, acc2, a_base, a2_base, c_base, s_base, k0, K, rmask, nmask, ka, kb, A_F32: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, MASK_K: tl.constexpr, LUT: tl.constexpr, TWO: tl.constexpr,
                PROMOTE: tl.constexpr):
    """One K tile: load activation/code/scale tiles at ``k0``, decode the operand ``B`` once, accumulate.

    ``c_base`` addresses code bytes ``[BN, BK/16, 8]`` or, with ``LUT``, int32 code words
    ``[BN, BK/16, 2]`` (4 bytes each). With ``TWO`` the same decoded tile also multiplies the
    second (dense RAC) operand at ``a2_base``, into its own accumulator ``acc2`` (SPEC §3.1: the
    compensation is a second accumulation with its own alpha). Returns ``(acc, acc2)``.
    """
    cdiv: tl.constexpr = 8 if LUT else 2  # K elements per addressed code unit
    if MASK_K:
        amask = rmask[:, None] & ((k0 + ka) < K)[None, :]
        a = tl.load(a_base + k0, mask=amask, other=0.0)
        if TWO:
            a2 = tl.load(a2_base + k0, mask=amask, other=0.0)
        kin = (k0 + kb * 16) < K
        codes3 = tl.load(c_base + k0 // cdiv, mask=nmask[:, None, None] & kin[None, :, None], other=0)
        s2 = tl.load(s_base + k0 // 16, mask=nmask[:, None] & kin[None, :], other=0)
    else:  # full tile: masks constant along K, so the loads vectorise
        a = tl.load(a_base + k0, mask=rmask[:, None], other=0.0)
        if TWO:
            a2 = tl.load(a2_base + k0, mask=rmask[:, None], other=0.0)
        codes3 = tl.load(c_base + k0 // cdiv, mask=nmask[:, None, None], other=0)
        s2 = tl.load(s_base + k0 // 16, mask=nmask[:, None], other=0)
    if A_F32:
        a = a.to(tl.float32)
    if LUT:
        w = _decode_w_tile_lut(codes3, s2, A_F32, BN, BK)
    else:
        w = _decode_w_tile(codes3, tl.expand_dims(s2, 2), A_F32, BN, BK)
    if PROMOTE:
        acc = add_rn(acc, dot_acc(w, tl.trans(a), tl.full(acc.shape, 0.0, tl.float32)))
        if TWO:
            acc2 = add_rn(acc2, dot_acc(w, tl.trans(a2), tl.full(acc2.shape, 0.0, tl.float32)))
    else:
        acc = dot_acc(w, tl.trans(a), acc)
        if TWO:
            acc2 = dot_acc(w, tl.trans(a2), acc2)
    return acc, acc2


@triton.jit
def _dense_segment(
    acc, acc2, a_ptr, stride_am, a2_ptr, stride_a2m, K, rows, rmask, w_codes_ptr, stride_wn, w_scales_ptr, stride_sn,
    ncols64, nmask, pid_k, SPLIT_K: tl.constexpr, A_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, STAGES: tl.constexpr, DECODE: tl.constexpr, TWO: tl.constexpr, PROMOTE_K: tl.constexpr,
):
    """``acc += B[ncols, :] @ A[rows, :]^T`` (and ``acc2 += B[ncols, :] @ A2[rows, :]^T`` with ``TWO``)
    over this split's K tiles (tile t goes to split t % SPLIT_K). Returns ``(acc, acc2)``.

    The dense RAC operand shares the K loop and the decoded weight tile: one decode, two MMAs per
    tile. (Two back-to-back pipelined K loops, the earlier form, gave wrong sums for M > 64 on the
    H200 with Triton 3.6 while the interpreter was exact; see BENCHMARKS.md.)

    Two-level accumulation (``PROMOTE_K > 0``): the tensor cores sum ``PROMOTE_K // BK`` K tiles of
    this split (at least one) into a zeroed partial, which ``add_rn`` adds to ``acc``. Chunks of
    several tiles are an inner loop of their own, so Triton still pipelines its loads and keeps the
    wgmma asynchronous (``wgmma.wait_group 3``); only the chunk boundary waits.
    """
    LUT: tl.constexpr = (DECODE == 1) and (not INTERP)
    ka = tl.arange(0, BK)
    kb = tl.arange(0, BK // 16)
    rows64 = rows.to(tl.int64)
    a_base = a_ptr + rows64[:, None] * stride_am + ka[None, :]
    a2_base = a2_ptr + rows64[:, None] * stride_a2m + ka[None, :]
    if LUT:  # int32 words: 2 per 16-element block (row stride K/2 bytes is a multiple of 8)
        kw = tl.arange(0, 2)
        c_base = (w_codes_ptr.to(tl.pointer_type(tl.int32)) + ncols64[:, None, None] * (stride_wn // 4)
                  + (kb[None, :, None] * 2 + kw[None, None, :]))
    else:
        kj = tl.arange(0, 8)
        c_base = w_codes_ptr + ncols64[:, None, None] * stride_wn + (kb[None, :, None] * 8 + kj[None, None, :])
    s_base = w_scales_ptr + ncols64[:, None] * stride_sn + kb[None, :]
    k_full = (K // BK) * BK
    TILES: tl.constexpr = PROMOTE_K // BK  # K tiles per promoted partial sum (<= 1: every tile)
    if TILES > 1:
        CH: tl.constexpr = BK * SPLIT_K * TILES
        for kc in tl.range(ub(pid_k * BK), ub(k_full), CH, num_stages=1):
            part = tl.full(acc.shape, 0.0, tl.float32)
            part2 = tl.full(acc2.shape, 0.0, tl.float32)
            for k0 in tl.range(ub(kc), ub(tl.minimum(kc + CH, k_full)), BK * SPLIT_K, num_stages=STAGES):
                part, part2 = _dense_step(part, part2, a_base, a2_base, c_base, s_base, k0, K, rmask, nmask, ka, kb,
                                          A_F32, BN, BK, False, LUT, TWO, False)
            acc = add_rn(acc, part)
            if TWO:
                acc2 = add_rn(acc2, part2)
    else:
        for k0 in tl.range(ub(pid_k * BK), ub(k_full), BK * SPLIT_K, num_stages=STAGES):
            acc, acc2 = _dense_step(acc, acc2, a_base, a2_base, c_base, s_base, k0, K, rmask, nmask, ka, kb, A_F32, BN,
                                    BK, False, LUT, TWO, PROMOTE_K > 0)
    if k_full < K:
        if (k_full // BK) % SPLIT_K == pid_k:
            acc, acc2 = _dense_step(acc, acc2, a_base, a2_base, c_base, s_base, k_full, K, rmask, nmask, ka, kb, A_F32,
                                    BN, BK, True, LUT, TWO, PROMOTE_K > 0)
    return acc, acc2


@triton.jit
def _gathered_segment(
    acc, a2_ptr, stride_a2m, K2, gidx_ptr, rows, rmask, w_codes_ptr, stride_wn, w_scales_ptr, stride_sn,
    ncols64, nmask, k_lo, k_step, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    PROMOTE_K: tl.constexpr,
):
    """``acc += B[ncols, idx[t]] @ A2[rows, t]^T`` summed over the gathered columns ``t`` of the
    ``[M, K']`` operand in tiles ``k_lo, k_lo + k_step, ...``; two-level accumulation as in
    :func:`_dense_segment`."""
    TILES: tl.constexpr = PROMOTE_K // BK
    if TILES > 1:
        for kc in tl.range(ub(k_lo), ub(K2), k_step * TILES, num_stages=1):
            part = tl.full(acc.shape, 0.0, tl.float32)
            for k0 in tl.range(ub(kc), ub(tl.minimum(kc + k_step * TILES, K2)), k_step, num_stages=STAGES):
                part = _gathered_step(part, a2_ptr, stride_a2m, K2, gidx_ptr, rows, rmask, w_codes_ptr, stride_wn,
                                      w_scales_ptr, stride_sn, ncols64, nmask, k0, BK, False)
            acc = add_rn(acc, part)
    else:
        for k0 in tl.range(ub(k_lo), ub(K2), k_step, num_stages=STAGES):
            acc = _gathered_step(acc, a2_ptr, stride_a2m, K2, gidx_ptr, rows, rmask, w_codes_ptr, stride_wn,
                                 w_scales_ptr, stride_sn, ncols64, nmask, k0, BK, PROMOTE_K > 0)
    return acc


@triton.jit
def _gathered_step(acc, a2_ptr, stride_a2m, K2, gidx_ptr, rows, rmask, w_codes_ptr, stride_wn, w_scales_ptr, stride_sn,
                   ncols64, nmask, k0, BK: tl.constexpr, PROMOTE: tl.constexpr):
    """One gathered tile: operand columns ``k0 .. k0 + BK`` times weight channels ``idx[k0 ..]``."""
    kk = k0 + tl.arange(0, BK)
    rows64 = rows.to(tl.int64)
    a = tl.load(a2_ptr + rows64[:, None] * stride_a2m + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K2), other=0.0)
    c = tl.load(gidx_ptr + kk, mask=kk < K2, other=-1)
    valid = nmask[:, None] & (c >= 0)[None, :]
    cc = tl.maximum(c, 0)
    byte = tl.load(w_codes_ptr + ncols64[:, None] * stride_wn + (cc >> 1)[None, :], mask=valid, other=0).to(tl.int32)
    code = (byte >> ((cc & 1) * 4)[None, :]) & 15
    s = e4m3_value(tl.load(w_scales_ptr + ncols64[:, None] * stride_sn + (cc >> 4)[None, :], mask=valid, other=0).to(tl.int32))
    w = to_bf16(e2m1_value(code) * s)  # the operand B (exact in bf16)
    if PROMOTE:
        return add_rn(acc, dot_acc(w, tl.trans(a), tl.full(acc.shape, 0.0, tl.float32)))
    else:
        return dot_acc(w, tl.trans(a), acc)


@triton.jit
def _nvfp4_gemm_kernel(
    a_ptr, stride_am,
    w_codes_ptr, stride_wn, w_scales_ptr, stride_sn, w_sdec_ptr, xs_ptr,
    a2_ptr, stride_a2m, K2, gidx_ptr, rs_ptr,
    bias_ptr, out_ptr, stride_om, ws_ptr,
    M, N, K, M_BUCKET,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
    SEG2: tl.constexpr, A_F32: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr, DECODE: tl.constexpr,
    PROMOTE_K: tl.constexpr, XS: tl.constexpr, RS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    ncols = pid_n * BN + tl.arange(0, BN)
    nmask = ncols < N
    ncols64 = ncols.to(tl.int64)
    acc = tl.full((BN, BM), 0.0, tl.float32)
    if SEG2 > 0:
        acc2 = tl.full((BN, BM), 0.0, tl.float32)
    else:
        acc2 = tl.full((1, 1), 0.0, tl.float32)
    acc, acc2 = _dense_segment(acc, acc2, a_ptr, stride_am, a2_ptr, stride_a2m, K, rows, rmask, w_codes_ptr, stride_wn,
                               w_scales_ptr, stride_sn, ncols64, nmask, pid_k, SPLIT_K, A_F32, BM, BN, BK, STAGES, DECODE,
                               SEG2 == 1, PROMOTE_K)
    if SEG2 == 2:
        # per-element weight gathers are register-hungry: narrower K tiles than the dense loop
        GBK: tl.constexpr = 64 if BN * BM <= 64 * 64 else 32
        acc2 = _gathered_segment(acc2, a2_ptr, stride_a2m, K2, gidx_ptr, rows, rmask, w_codes_ptr, stride_wn,
                                 w_scales_ptr, stride_sn, ncols64, nmask, pid_k * GBK, GBK * SPLIT_K, BM, BN, GBK, STAGES,
                                 PROMOTE_K)
    omask = nmask[:, None] & rmask[None, :]
    rows64 = rows.to(tl.int64)
    if SPLIT_K == 1:
        sdec = tl.load(w_sdec_ptr)
        y = acc * row_alpha(xs_ptr, rows, rmask, sdec, XS)[None, :]
        if SEG2 > 0:
            y = y + acc2 * row_alpha(rs_ptr, rows, rmask, sdec, RS)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + ncols, mask=nmask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows64[None, :] * stride_om + ncols64[:, None], to_out(y, OUT_DTYPE), mask=omask)
    else:  # raw float32 partials; the reduction applies alpha once to the whole sum
        base = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + rows64[None, :] * N + ncols64[:, None], acc, mask=omask)
        if SEG2 > 0:
            base2 = ws_ptr + (SPLIT_K + pid_k).to(tl.int64) * M * N
            tl.store(base2 + rows64[None, :] * N + ncols64[:, None], acc2, mask=omask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, out_ptr, stride_om, M, N, w_sdec_ptr, xs_ptr, rs_ptr, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr, SEG2: tl.constexpr,
                          XS: tl.constexpr, RS: tl.constexpr):
    """``out = fl(sum_s ws[s] * alpha) (+ fl(sum_s ws2[s] * alpha_R)) (+ bias)``: split-K partials
    added in split order (deterministic), then the SPEC §3.1 epilogue of the whole sum."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc = acc + tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    rows = offs // N
    sdec = tl.load(w_sdec_ptr)
    y = acc * row_alpha(xs_ptr, rows, mask, sdec, XS)
    if SEG2 > 0:
        acc2 = tl.load(ws_ptr + SPLIT_K * M * N + offs, mask=mask, other=0.0)
        for s in range(1, SPLIT_K):
            acc2 = acc2 + tl.load(ws_ptr + (SPLIT_K + s) * M * N + offs, mask=mask, other=0.0)
        y = y + acc2 * row_alpha(rs_ptr, rows, mask, sdec, RS)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_om + n, to_out(y, OUT_DTYPE), mask=mask)


def _configs(small: bool, promote: bool = False):
    """Autotune candidates (BN weight rows x BM tokens x BK).

    With two-level accumulation the 128 x 256 / 256 x 128 tiles would spill (two float32 tiles of 128
    registers per thread each; ``python -m qpass.apps.bench.aot``). Its large tiles keep
    BM = 256 tokens per decoded weight tile (what made 128 x 256 the fastest ``mma`` tile: half the
    decode work per FLOP of BM = 128) with BN = 64 weight rows: 237-243 registers, no spills, except
    with the dense RAC operand, for which :func:`_prune` drops them."""
    cfgs = []
    if small:
        for bk, nw, ns in ((128, 4, 4), (256, 4, 3)):
            cfgs.append(triton.Config({"BK": bk, "STAGES": ns}, num_warps=nw, num_stages=ns))
    else:
        if promote:
            tiles = ((64, 256, 64, 8, 3), (64, 256, 64, 8, 4), (64, 256, 128, 8, 3), (128, 128, 64, 8, 4),
                     (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3))
        else:
            tiles = ((128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3))
        for bn, bm, bk, nw, ns in tiles:
            cfgs.append(triton.Config({"BN": bn, "BM": bm, "BK": bk, "STAGES": ns}, num_warps=nw, num_stages=ns))
    return cfgs


def _prune(configs, named_args, **kwargs):
    """The dense RAC operand (SEG2 = 1) under two-level accumulation keeps four float32 tiles live
    (the two accumulations of SPEC §3.1 and their partials): only the 64 x 64 tiles fit the registers
    there (``python -m qpass.apps.bench.aot --full --filter seg2=1``: 128 x 128 and 64 x 128 spill
    312-344 B of stack); with ``accumulation="mma"`` and either RAC operand the 256-wide tiles go.
    Every other launch keeps the full list."""
    if kwargs.get("SEG2") == 1 and kwargs.get("PROMOTE_K", 0) > 0:
        keep = [c for c in configs if c.kwargs.get("BM", 0) * c.kwargs.get("BN", 0) <= 64 * 64]
        return keep or configs
    if kwargs.get("SEG2", 0) > 0:  # accumulation="mma": the 128 x 256 / 256 x 128 tiles spill 0.6-1.4 kB with RAC
        keep = [c for c in configs if c.kwargs.get("BM", 0) * c.kwargs.get("BN", 0) <= 128 * 128]
        return keep or configs
    return configs


def _bench(fn, quantiles):
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


from qpass.backends.triton.tiles import pinned_tile  # noqa: E402 - tile selection only (autotune or pinned)

if not INTERP:
    _gemm_small = triton.autotune(configs=_configs(True),
                                  key=["M_BUCKET", "N", "K", "K2", "SEG2", "SPLIT_K", "BN", "BM", "DECODE", "PROMOTE_K"],
                                  do_bench=_bench)(_nvfp4_gemm_kernel)
    _gemm_large = {p: triton.autotune(configs=_configs(False, p), key=["M_BUCKET", "N", "K", "K2", "SEG2", "DECODE"],
                                      prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)(_nvfp4_gemm_kernel)
                   for p in (False, True)}


def _out_tl_dtype(torch_dtype):
    import torch

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[torch_dtype]


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


DECODES = {"ref": 0, "lut": 1}
ACCUMULATIONS = ("two_level", "mma")
# Products per tensor-core partial sum under two-level accumulation. Small-M (decode) kernel: every
# K tile (memory-bound; the synchronous wgmma this needs costs nothing measurable). Large-M kernel:
# 1024 (16 tiles of 64 or 8 of 128) as a pipelined inner loop, since waiting for every tile's wgmma
# cost 1.5-1.6x there (BENCHMARKS.md).
PROMOTE_K_SMALL = 1
PROMOTE_K_LARGE = 1024


def default_decode() -> str:
    """Weight decode variant: ``QPASS_NVFP4_DECODE`` = ``ref`` (arithmetic, default) or ``lut`` (PRMT table)."""
    import os

    name = os.environ.get("QPASS_NVFP4_DECODE", "ref")
    if name not in DECODES:
        raise ValueError(f"QPASS_NVFP4_DECODE must be one of {sorted(DECODES)}, got {name!r}")
    return name


def default_accumulation() -> str:
    """GEMM accumulation: ``QPASS_GEMM_ACCUMULATION`` = ``two_level`` (default) or ``mma``.

    ``mma`` keeps the whole K sum in the tensor core's accumulator (``tl.dot(a, b, acc)``), whose
    additions on sm_90 are not IEEE round-to-nearest: the error grows linearly with K (relative
    Frobenius error 1.1e-5 - 2.4e-5 at K = 8192 for ours and cuBLAS alike, BENCHMARKS.md).
    ``two_level`` sums each K tile (64-256 products) in the tensor core from zero and adds that
    partial into the float32 accumulator with an IEEE ``add.rn`` (DeepSeek-V3's "promotion to CUDA
    cores", here every K tile), bounding the biased in-MMA error to one tile.
    """
    import os

    name = os.environ.get("QPASS_GEMM_ACCUMULATION", "two_level")
    if name not in ACCUMULATIONS:
        raise ValueError(f"QPASS_GEMM_ACCUMULATION must be one of {sorted(ACCUMULATIONS)}, got {name!r}")
    return name


def scale_mode(s, m: int) -> int:
    """``row_alpha`` mode of an activation scale tensor: 0 none, 1 one value, 2 one per row."""
    if s is None:
        return 0
    return 2 if s.numel() > 1 else 1


def launch_nvfp4_gemm(a, w_codes, w_scales, w_sdec, out, *, bias=None, a2=None, gidx=None, num_sms=132, decode=None,
                      accumulation=None, promote_k=None, xs=None, rs=None):
    """``out [M, N] = fl(acc(a B_W^T) * alpha) (+ fl(acc(a2 B_W[:, cols]^T) * alpha_R)) (+ bias)`` (SPEC §3.1).

    Args:
        a: bf16 ``[M, K]`` (tensor-core path) or fp16/fp32 (IEEE float32 path), unit column stride:
            the activation (W4A16) or ``B_X`` (W4A4: exact in bf16).
        w_codes, w_scales: uint8 ``[N, K/2]`` / ``[N, K/16]`` (contiguous); w_sdec float32 ``[1]``.
        out: ``[M, N]`` output (bf16/fp16/fp32), unit column stride.
        bias: optional ``[N]``.
        a2: optional second-segment operand ``B_R``, bf16 ``[M, K]`` (dense) or ``[M, K']`` with ``gidx``.
        gidx: int32 ``[K']`` weight channel per ``a2`` column (-1 = padding) for the gathered segment.
        xs: float32 ``S_dec_X``: None (W4A16: ``alpha = S_dec_W``), ``[1]`` (per tensor) or ``[M]``
            (per row); ``alpha = fl(S_dec_X * S_dec_W)``.
        rs: float32 ``S_dec_R`` of the second segment (same shapes); ``alpha_R = fl(S_dec_R * S_dec_W)``.
        decode: ``"ref"`` / ``"lut"`` (see :func:`default_decode`).
        accumulation: ``"two_level"`` / ``"mma"`` (see :func:`default_accumulation`).
        promote_k: override of the products per promoted partial sum under ``two_level``
            (``PROMOTE_K_SMALL`` / ``PROMOTE_K_LARGE`` by kernel); for experiments and tests.
    """
    import torch

    m, k = a.shape
    n = w_codes.shape[0]
    seg2 = 0 if a2 is None else (2 if gidx is not None else 1)
    k2 = a2.shape[1] if a2 is not None else 0
    a_f32 = a.dtype != torch.bfloat16
    if a_f32 and a2 is not None:
        raise ValueError("the RAC second segment needs a bf16 activation operand")
    out_dt = _out_tl_dtype(out.dtype)
    dummy = w_sdec
    m_bucket = min(triton.next_power_of_2(m), 4096)
    dec = DECODES[decode or default_decode()]
    if w_codes.stride(0) % 8 or w_codes.data_ptr() % 4:  # the table decode reads aligned int32 words
        dec = 0
    accumulation = accumulation or default_accumulation()
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {ACCUMULATIONS}, got {accumulation!r}")
    promote = accumulation == "two_level"

    def pk(default: int) -> int:
        return 0 if not promote else (promote_k or default)

    if a2 is not None and rs is None:
        raise ValueError("the RAC second segment needs its activation scale rs (S_dec_R)")
    xs_mode, rs_mode = scale_mode(xs, m), scale_mode(rs, m)
    common = dict(SEG2=seg2, A_F32=a_f32, HAS_BIAS=bias is not None, OUT_DTYPE=out_dt, DECODE=dec, XS=xs_mode,
                  RS=rs_mode, enable_fp_fusion=False)
    args = [a, a.stride(0), w_codes, w_codes.stride(0), w_scales, w_scales.stride(0), w_sdec,
            xs if xs is not None else dummy, a2 if a2 is not None else dummy,
            a2.stride(0) if a2 is not None else 0, k2, gidx if gidx is not None else dummy, rs if rs is not None else dummy,
            bias if bias is not None else dummy, out, out.stride(0)]
    nseg = 2 if seg2 else 1  # float32 partials per split: one per accumulation
    if INTERP:
        bm, bn, bk = 16, 32, 64
        split = 2 if k > 2 * bk else 1
        ws = torch.empty(nseg * split, m, n, dtype=torch.float32, device=a.device) if split > 1 else dummy
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
        # chunks of two 64-wide tiles: the interpreter runs the nested (large-M) two-level loop
        _nvfp4_gemm_kernel[grid](*args, ws, m, n, k, m_bucket, BM=bm, BN=bn, BK=bk, SPLIT_K=split, STAGES=1, num_warps=4,
                                 PROMOTE_K=pk(2 * bk), **common)
    elif m <= 64 or (m <= 128 and 2 * triton.cdiv(n, 128) * triton.cdiv(m, 128) <= num_sms):
        # M <= 64; and M <= 128 when 128 x 128 tiles would fill at most half of the SMs: there the
        # split-K small-M kernel (two 64-row tiles) is 2-2.6x faster on the H200 (N = 4096), while at
        # N = 14336 the large tiling is ahead (0.39x vs 0.28x BF16); BENCHMARKS.md
        bm = min(64, max(16, triton.next_power_of_2(m)))
        bn = 64
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
        split = max(1, min(8, _pow2_floor((2 * num_sms) // tiles), _pow2_floor(max(1, k // 512))))
        ws = torch.empty(nseg * split, m, n, dtype=torch.float32, device=a.device) if split > 1 else dummy
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
        tile = pinned_tile("gemm_small", M_BUCKET=m_bucket, N=n, K=k, K2=k2, SEG2=seg2, SPLIT_K=split, BN=bn, BM=bm,
                           DECODE=dec, PROMOTE_K=pk(PROMOTE_K_SMALL))
        kern = _gemm_small if tile is None else _nvfp4_gemm_kernel
        kern[grid](*args, ws, m, n, k, m_bucket, BM=bm, BN=bn, SPLIT_K=split, PROMOTE_K=pk(PROMOTE_K_SMALL),
                   **common, **(tile.kwargs() if tile is not None else {}))
    else:
        split = 1
        ws = dummy
        tile = pinned_tile("gemm_large", M_BUCKET=m_bucket, N=n, K=k, K2=k2, SEG2=seg2, DECODE=dec,
                           PROMOTE_K=pk(PROMOTE_K_LARGE))
        if tile is None:
            grid = lambda meta: (triton.cdiv(n, meta["BN"]), triton.cdiv(m, meta["BM"]), 1)  # noqa: E731
            _gemm_large[promote][grid](*args, ws, m, n, k, m_bucket, SPLIT_K=1, PROMOTE_K=pk(PROMOTE_K_LARGE), **common)
        else:
            t = dict(tile.meta)
            grid = (triton.cdiv(n, t["BN"]), triton.cdiv(m, t["BM"]), 1)
            _nvfp4_gemm_kernel[grid](*args, ws, m, n, k, m_bucket, SPLIT_K=1, PROMOTE_K=pk(PROMOTE_K_LARGE), **common,
                                     **tile.kwargs())
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, bias if bias is not None else dummy, out, out.stride(0), m, n, w_sdec, xs if xs is not None else dummy,
            rs if rs is not None else dummy, SPLIT_K=split, HAS_BIAS=bias is not None, OUT_DTYPE=out_dt, BLOCK=block,
            SEG2=seg2, XS=xs_mode, RS=rs_mode, num_warps=4, enable_fp_fusion=False,
        )
