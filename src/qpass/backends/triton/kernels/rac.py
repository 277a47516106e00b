"""Residual quantization kernels of RAC (SPEC §2, ``qpass.quant.rac.rac_reference``).

``R = fl(float(x) - float(x_hat))`` is never stored: each kernel re-forms it from ``x`` and the
activation quantization (recomputed bit-identically in masked mode, read back from the ``qa``
bytes in gathered mode) and quantizes it with the residual's own global scale.

* masked: quantize all of ``R`` in 1x16 blocks (codes/scales of every block are written, as the
  reference does), then ``comp = bf16(mask ? v : 0)`` ``[M, K]`` with ``v`` the GEMM operand
  ``B_R = e2m1 * s_b`` (``OPERAND``, SPEC §3.1) or the dequantized ``DQ_f32(Q_R(R))`` (parity views).
* gathered: ``G[:, t] = R[:, idx[t]]`` (``idx`` sorted, ``-1`` = zero padding) quantized as its own
  blocks ``[M, K']``; ``comp_g = bf16(B_R)`` or ``bf16(DQ(Q_R(G)))``; optionally also scattered back
  into a dense ``[M, K]`` operand (per-token selection, where every row has its own channels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    BF16_MAX,
    INTERP,
    act_operand_bf16,
    e4m3_value,
    load_tile_f32,
    nvfp4_decode_f32,
    nvfp4_global,
    rmax,
    to_bf16,
    ub,
)
from .nvfp4_quant import launch_row_tiled, load_global, nvfp4_quant_tile, store_codes_scales, store_global


@triton.jit
def _residual_masked_kernel(
    x_ptr, stride_xm, M, K,
    amax_x_ptr, amax_r_ptr, mask_ptr, xhat_lim,
    codes_ptr, scales_ptr, comp_ptr, senc_ptr, sdec_ptr,
    M_BUCKET, BM: tl.constexpr, BK: tl.constexpr, ROW_ITERS: tl.constexpr, STAGES: tl.constexpr,
    PER_ROW: tl.constexpr, MASK_2D: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_COMP: tl.constexpr, WRITE_GLOBAL: tl.constexpr, OPERAND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_k * BK + tl.arange(0, BK)
    cmask = cols < K
    if not MASK_2D:
        chmask = tl.load(mask_ptr + cols, mask=cmask, other=0) != 0
    for it in tl.range(ROW_ITERS, num_stages=STAGES):
        rows = (pid_m * ROW_ITERS + it) * BM + tl.arange(0, BM)
        x, rmask, mask, rows64 = load_tile_f32(x_ptr, stride_xm, rows, cols, M, K)
        _, xs_dec, xmult = load_global(amax_x_ptr, rows, rmask, BM, PER_ROW)
        _, _, xh, _ = nvfp4_quant_tile(x, xs_dec, xmult, BM, BK)
        r = x - act_operand_bf16(xh, xhat_lim).to(tl.float32)
        r = tl.where(mask, r, 0.0)
        rs_enc, rs_dec, rmult = load_global(amax_r_ptr, rows, rmask, BM, PER_ROW)
        codes, s_b, rh, rb = nvfp4_quant_tile(r, rs_dec, rmult, BM, BK)
        if OPERAND:  # B_R (SPEC §3.1: S_dec_R goes to the compensation GEMM's alpha_R)
            rh = rb
        if WRITE_CODES:
            store_codes_scales(codes_ptr, scales_ptr, codes, s_b, rows64, rmask, pid_k * (BK // 2), pid_k * (BK // 16), K, BM, BK)
        if WRITE_GLOBAL:
            store_global(senc_ptr, sdec_ptr, tl.reshape(rs_enc, (BM,)), tl.reshape(rs_dec, (BM,)), rows, rmask,
                         pid_k == 0, (pid_m == 0) & (pid_k == 0) & (it == 0), PER_ROW)
        if WRITE_COMP:
            if MASK_2D:
                sel = tl.load(mask_ptr + rows64[:, None] * K + cols[None, :], mask=mask, other=0) != 0
            else:
                sel = chmask[None, :] & rmask[:, None]
            comp = to_bf16(tl.where(sel, rh, 0.0))
            tl.store(comp_ptr + rows64[:, None] * K + cols[None, :], comp, mask=mask)


@triton.jit
def _gather_residual(x_ptr, stride_xm, K, qa_codes_ptr, qa_scales_ptr, qs_dec, rows64, rmask, idx, xhat_lim):
    """``R[rows, idx]`` float32 ``[BM, BKG]`` from x and the activation bytes (0 where idx < 0)."""
    valid = rmask[:, None] & (idx >= 0)
    c = tl.maximum(idx, 0)
    xv = tl.load(x_ptr + rows64[:, None] * stride_xm + c, mask=valid, other=0.0).to(tl.float32)
    byte = tl.load(qa_codes_ptr + rows64[:, None] * (K // 2) + (c >> 1), mask=valid, other=0).to(tl.int32)
    code = (byte >> ((c & 1) * 4)) & 15
    sb = e4m3_value(tl.load(qa_scales_ptr + rows64[:, None] * (K // 16) + (c >> 4), mask=valid, other=0).to(tl.int32))
    xh = act_operand_bf16(nvfp4_decode_f32(code, sb, qs_dec), xhat_lim).to(tl.float32)
    return tl.where(valid, xv - xh, 0.0)


@triton.jit
def _load_idx(idx_ptr, rows64, rmask, t, KP, IDX_2D: tl.constexpr):
    """Channel ids ``[BM, BKG]`` or ``[1, BKG]`` of gathered columns ``t`` (-1 beyond K')."""
    tmask = t < KP
    if IDX_2D:
        return tl.load(idx_ptr + rows64[:, None] * KP + t[None, :], mask=rmask[:, None] & tmask[None, :], other=-1)
    else:
        return tl.load(idx_ptr + t, mask=tmask, other=-1)[None, :]


@triton.jit
def _residual_gathered_kernel(
    x_ptr, stride_xm, M, K, KP,
    qa_codes_ptr, qa_scales_ptr, qa_sdec_ptr,
    idx_ptr, amax_g_ptr, xhat_lim,
    codes_ptr, scales_ptr, comp_ptr, dense_ptr, senc_ptr, sdec_ptr,
    BM: tl.constexpr, BKG: tl.constexpr,
    PER_ROW: tl.constexpr, IDX_2D: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_COMP: tl.constexpr, WRITE_DENSE: tl.constexpr, WRITE_GLOBAL: tl.constexpr,
    OPERAND: tl.constexpr,
):
    # Per-tensor scope: program (pid_m, pid_k) handles rows [pid_m*BM, +BM) x gathered columns
    # [pid_k*BKG, +BKG), global amax given. Per-row scope (PER_ROW): grid (cdiv(M, BM), 1); the
    # program first sweeps all K' columns for the per-row amax of G, then quantizes.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    if PER_ROW:
        qs_dec = tl.load(qa_sdec_ptr + rows, mask=rmask, other=1.0)[:, None]
        gmax = tl.full((BM,), 0, tl.int32)
        for k0 in range(0, ub(KP), BKG):
            t = k0 + tl.arange(0, BKG)
            idx = _load_idx(idx_ptr, rows64, rmask, t, KP, IDX_2D)
            r = _gather_residual(x_ptr, stride_xm, K, qa_codes_ptr, qa_scales_ptr, qs_dec, rows64, rmask, idx, xhat_lim)
            gmax = tl.maximum(gmax, rmax(tl.abs(r).to(tl.int32, bitcast=True), 1))
        amax_g = gmax.to(tl.float32, bitcast=True)
        k_start = 0
        k_stop = ub(KP)
    else:
        qs_dec = tl.full((BM, 1), 0.0, tl.float32) + tl.load(qa_sdec_ptr)
        amax_g = tl.full((BM,), 0.0, tl.float32) + tl.load(amax_g_ptr)
        k_start = pid_k * BKG
        k_stop = k_start + BKG
    s_enc, s_dec, mult = nvfp4_global(amax_g)
    if WRITE_GLOBAL:  # per row: the grid has one column of programs, each writes its rows
        store_global(senc_ptr, sdec_ptr, s_enc, s_dec, rows, rmask, True, (pid_m == 0) & (pid_k == 0), PER_ROW)
    for k0 in range(ub(k_start), ub(k_stop), BKG):
        t = k0 + tl.arange(0, BKG)
        tmask = t < KP
        idx = _load_idx(idx_ptr, rows64, rmask, t, KP, IDX_2D)
        r = _gather_residual(x_ptr, stride_xm, K, qa_codes_ptr, qa_scales_ptr, qs_dec, rows64, rmask, idx, xhat_lim)
        codes, s_b, gh, gb = nvfp4_quant_tile(r, s_dec[:, None], mult[:, None], BM, BKG)
        if OPERAND:
            gh = gb
        omask = rmask[:, None] & tmask[None, :]
        if WRITE_CODES:
            store_codes_scales(codes_ptr, scales_ptr, codes, s_b, rows64, rmask, k0 // 2, k0 // 16, KP, BM, BKG)
        comp = to_bf16(gh)
        if WRITE_COMP:
            tl.store(comp_ptr + rows64[:, None] * KP + t[None, :], comp, mask=omask)
        if WRITE_DENSE:
            dmask = omask & (idx >= 0)
            tl.store(dense_ptr + rows64[:, None] * K + tl.maximum(idx, 0), comp, mask=dmask)


if not INTERP:
    from .nvfp4_quant import _bench, big_configs

    _masked_tuned = triton.autotune(
        configs=big_configs(), key=["M_BUCKET", "K", "PER_ROW", "MASK_2D", "WRITE_CODES", "WRITE_COMP"], do_bench=_bench,
    )(_residual_masked_kernel)


def launch_residual_masked(x, amax_x, amax_r, per_row, mask, *, codes=None, scales=None, comp=None, s_enc=None, s_dec=None,
                           xhat_lim=BF16_MAX, operand=False):
    """Masked-mode residual quantization over ``x [M, K]``; ``mask`` int8 ``[K]`` or ``[M, K]``;
    ``xhat_lim``: the activation operand's bound (``launch_nvfp4_quant``); ``operand``: ``comp`` is the
    GEMM operand ``B_R`` (``e2m1 * s_b``, SPEC §3.1) instead of the dequantized ``DQ(Q_R(R))``."""
    m, k = x.shape
    dummy = amax_x
    args = (
        x, x.stride(0), m, k, amax_x, amax_r, mask, float(xhat_lim),
        codes if codes is not None else dummy, scales if scales is not None else dummy,
        comp if comp is not None else dummy,
        s_enc if s_enc is not None else dummy, s_dec if s_dec is not None else dummy,
        min(triton.next_power_of_2(m), 1 << 16),
    )
    flags = dict(
        PER_ROW=per_row, MASK_2D=mask.dim() == 2, WRITE_CODES=codes is not None, WRITE_COMP=comp is not None,
        WRITE_GLOBAL=s_enc is not None, OPERAND=operand, enable_fp_fusion=False,
    )
    launch_row_tiled(_residual_masked_kernel, None if INTERP else _masked_tuned, "rac_masked", args, flags, m, k,
                     PER_ROW=per_row, MASK_2D=mask.dim() == 2, WRITE_CODES=codes is not None, WRITE_COMP=comp is not None)


def launch_residual_gathered(
    x, qa_codes, qa_scales, qa_sdec, idx, amax_g, per_row, *,
    codes=None, scales=None, comp=None, dense=None, s_enc=None, s_dec=None, xhat_lim=BF16_MAX, operand=False,
):
    """Gathered-mode residual quantization; ``idx`` int32 ``[K']`` or ``[M, K']`` (-1 = padding);
    ``xhat_lim``: the activation operand's bound (``launch_nvfp4_quant``); ``operand``: ``comp`` /
    ``dense`` hold ``B_R`` instead of the dequantized residual (as :func:`launch_residual_masked`)."""
    m, k = x.shape
    kp = idx.shape[-1]
    if INTERP:
        bm, bkg, nw = 8, 32, 4
    else:
        bm = 1 if m <= 1 else (4 if m < 64 else 16)
        bkg, nw = 128, 4
    dummy = qa_sdec
    grid = (triton.cdiv(m, bm), 1 if per_row else triton.cdiv(kp, bkg))
    _residual_gathered_kernel[grid](
        x, x.stride(0), m, k, kp, qa_codes, qa_scales, qa_sdec, idx,
        amax_g if amax_g is not None else dummy, float(xhat_lim),
        codes if codes is not None else dummy, scales if scales is not None else dummy,
        comp if comp is not None else dummy, dense if dense is not None else dummy,
        s_enc if s_enc is not None else dummy, s_dec if s_dec is not None else dummy,
        BM=bm, BKG=bkg, PER_ROW=per_row, IDX_2D=idx.dim() == 2,
        WRITE_CODES=codes is not None, WRITE_COMP=comp is not None, WRITE_DENSE=dense is not None,
        WRITE_GLOBAL=s_enc is not None, OPERAND=operand, num_warps=nw, enable_fp_fusion=False,
    )
