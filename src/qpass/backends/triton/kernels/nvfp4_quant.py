"""NVFP4 quantization kernel (SPEC §3), optionally fused with the RAC statistics of SPEC §2.

One program quantizes a ``[BM, BK]`` tile (``BK`` a multiple of 16) with the arithmetic of
``qpass.quant.nvfp4.nvfp4_quantize`` (same op order, ``tl.div_rn``, no FMA contraction) and can in
the same pass:

* write ``B_X = bf16(e2m1 * s_b)`` (exact: the W4A4 GEMM's activation operand, SPEC §3.1; ``S_dec_X``
  goes to the GEMM's alpha) and/or ``x_hat = bf16(clamp(fl(fl(e2m1 * s_b) * s_dec), -lim, lim))``
  (the dense fake-quant, saturated to the activation dtype's range: ``nvfp4_act_operand``; RAC's
  residual ``R = x - x_hat`` is formed from it),
* form ``R = fl(float(x) - float(x_hat))`` and accumulate RAC statistics with integer atomics:
  exact fixed-point channel scores ``sum_i floor(fl(R^2) * 2^shift)`` (int64, ``qpass.quant.rac``),
  and the bit patterns of ``max|R|`` per channel and per row (int32 atomic max),
* write ``|R|`` (token selection ranks each row by it).

Integer addition and max are associative, so the statistics do not depend on tile order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    BF16_MAX,
    INTERP,
    act_operand_bf16,
    e4m3_byte,
    frexp_exp,
    load_tile_f32,
    nvfp4_block_scale,
    nvfp4_decode_f32,
    nvfp4_elem_mult,
    nvfp4_encode,
    nvfp4_global,
    nvfp4_operand_f32,
    pack_nibbles,
    pow2_f32,
    rmax,
    rsum,
    to_bf16,
)


@triton.jit
def nvfp4_quant_tile(x, s_dec, mult, BM: tl.constexpr, BK: tl.constexpr):
    """Quantize float32 ``x [BM, BK]`` with per-row (``[BM, 1]``) ``s_dec``/``mult``.

    Returns ``(codes [BM, BK] int32, s_b [BM, BK/16] float32, x_hat_f32 [BM, BK], b [BM, BK])`` where
    x_hat is the float32 dequantized value before the bf16 rounding and ``b = e2m1 * s_b`` the exact
    GEMM operand (SPEC §3.1; unused outputs are dead code for the compiler).
    """
    x3 = tl.reshape(x, (BM, BK // 16, 16))
    vmax = rmax(tl.abs(x3), 2)
    s_b = nvfp4_block_scale(vmax, mult)
    enc = nvfp4_elem_mult(s_b, s_dec)
    codes3 = nvfp4_encode(x3, enc[:, :, None])
    xh3 = nvfp4_decode_f32(codes3, s_b[:, :, None], s_dec[:, :, None])
    b3 = nvfp4_operand_f32(codes3, s_b[:, :, None])
    return tl.reshape(codes3, (BM, BK)), s_b, tl.reshape(xh3, (BM, BK)), tl.reshape(b3, (BM, BK))


@triton.jit
def load_global(amax_ptr, rows, rmask, BM: tl.constexpr, PER_ROW: tl.constexpr):
    """``(s_enc, s_dec, mult)`` as ``[BM, 1]`` float32 from a per-tensor ``[1]`` or per-row ``[M]`` amax."""
    if PER_ROW:
        amax = tl.load(amax_ptr + rows, mask=rmask, other=0.0)
    else:
        amax = tl.full((BM,), 0.0, tl.float32) + tl.load(amax_ptr)
    s_enc, s_dec, mult = nvfp4_global(amax)
    return s_enc[:, None], s_dec[:, None], mult[:, None]


@triton.jit
def store_codes_scales(codes_ptr, scales_ptr, codes, s_b, rows64, rmask, b0, s0, KW, BM: tl.constexpr, BK: tl.constexpr):
    """Store one quantized tile, columns ``[c0, c0 + BK)`` of a row-major ``[M, KW]`` NVFP4 tensor,
    given as its first code byte ``b0 = c0 / 2`` and first scale ``s0 = c0 / 16``.

    ``codes`` int32 ``[BM, BK]`` (packed two per byte into ``codes_ptr``, uint8 ``[M, KW/2]``, low
    nibble = even column), ``s_b`` float32 ``[BM, BK/16]`` (E4M3 bytes into ``scales_ptr``, uint8
    ``[M, KW/16]``); rows outside ``rmask`` and bytes beyond ``KW`` are not written.
    """
    bcols = b0 + tl.arange(0, BK // 2)
    tl.store(codes_ptr + rows64[:, None] * (KW // 2) + bcols[None, :], pack_nibbles(codes, BM, BK),
             mask=rmask[:, None] & (bcols[None, :] < KW // 2))
    scols = s0 + tl.arange(0, BK // 16)
    tl.store(scales_ptr + rows64[:, None] * (KW // 16) + scols[None, :], e4m3_byte(s_b).to(tl.uint8),
             mask=rmask[:, None] & (scols[None, :] < KW // 16))


@triton.jit
def store_global(senc_ptr, sdec_ptr, s_enc, s_dec, rows, rmask, first_col, first_tile, PER_ROW: tl.constexpr):
    """Store the global scales ``s_enc``/``s_dec`` float32 ``[BM]``: per row (``[M]``, written by
    the programs of the first column tile, ``first_col``) or per tensor (``[1]``, written once, by
    the program whose ``first_tile`` is true; every row holds the same value)."""
    if PER_ROW:
        if first_col:
            tl.store(senc_ptr + rows, s_enc, mask=rmask)
            tl.store(sdec_ptr + rows, s_dec, mask=rmask)
    else:
        if first_tile:
            tl.store(senc_ptr, rmax(s_enc, 0))
            tl.store(sdec_ptr, rmax(s_dec, 0))


@triton.jit
def _nvfp4_quant_kernel(
    x_ptr, stride_xm, M, K,
    amax_ptr, xhat_lim,
    codes_ptr, scales_ptr, xhat_ptr, bx_ptr, senc_ptr, sdec_ptr,
    gamax_bits_ptr, log2m,
    scores_ptr, rcolmax_ptr, rrowmax_ptr, rabs_ptr, M_BUCKET,
    BM: tl.constexpr, BK: tl.constexpr, ROW_ITERS: tl.constexpr, STAGES: tl.constexpr,
    PER_ROW: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_XHAT: tl.constexpr, WRITE_GLOBAL: tl.constexpr,
    SCORES: tl.constexpr, RSTATS: tl.constexpr, RABS: tl.constexpr, WRITE_BX: tl.constexpr,
):
    # program (pid_m, pid_k): columns [pid_k*BK, +BK), rows [pid_m*ROW_ITERS*BM, +ROW_ITERS*BM) in
    # ROW_ITERS steps of BM; per-channel statistics stay in registers until one atomic per channel.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_k * BK + tl.arange(0, BK)
    cmask = cols < K
    shift = 0
    if SCORES:
        gamax = tl.load(gamax_bits_ptr).to(tl.float32, bitcast=True)
        e_a = frexp_exp(gamax)
        shift = tl.minimum(tl.maximum(61 - log2m - 2 * e_a, -100), 100)
        shift = tl.where(gamax == 0.0, 0, shift)
    score_acc = tl.full((BK,), 0, tl.int64)
    colmax_acc = tl.full((BK,), 0, tl.int32)
    for it in tl.range(ROW_ITERS, num_stages=STAGES):
        rows = (pid_m * ROW_ITERS + it) * BM + tl.arange(0, BM)
        x, rmask, mask, rows64 = load_tile_f32(x_ptr, stride_xm, rows, cols, M, K)

        s_enc, s_dec, mult = load_global(amax_ptr, rows, rmask, BM, PER_ROW)
        codes, s_b, xh, bx = nvfp4_quant_tile(x, s_dec, mult, BM, BK)

        if WRITE_CODES:
            store_codes_scales(codes_ptr, scales_ptr, codes, s_b, rows64, rmask, pid_k * (BK // 2), pid_k * (BK // 16), K, BM, BK)
        if WRITE_GLOBAL:
            store_global(senc_ptr, sdec_ptr, tl.reshape(s_enc, (BM,)), tl.reshape(s_dec, (BM,)), rows, rmask,
                         pid_k == 0, (pid_m == 0) & (pid_k == 0) & (it == 0), PER_ROW)

        xh_bf = act_operand_bf16(xh, xhat_lim)
        if WRITE_XHAT:
            tl.store(xhat_ptr + rows64[:, None] * K + cols[None, :], xh_bf, mask=mask)
        if WRITE_BX:  # the W4A4 GEMM operand B_X (exact in bf16; S_dec_X goes to the GEMM's alpha)
            tl.store(bx_ptr + rows64[:, None] * K + cols[None, :], to_bf16(bx), mask=mask)

        if SCORES or RSTATS or RABS:
            r = x - xh_bf.to(tl.float32)
            r = tl.where(mask, r, 0.0)
            if SCORES:
                terms = ((r * r) * pow2_f32(shift)).to(tl.int64)
                score_acc += rsum(terms, 0)
            if RSTATS:
                rb = tl.abs(r).to(tl.int32, bitcast=True)
                colmax_acc = tl.maximum(colmax_acc, rmax(rb, 0))
                tl.atomic_max(rrowmax_ptr + rows, rmax(rb, 1), mask=rmask, sem="relaxed")
            if RABS:
                tl.store(rabs_ptr + rows64[:, None] * K + cols[None, :], tl.abs(r), mask=mask)
    if SCORES:
        tl.atomic_add(scores_ptr + cols, score_acc, mask=cmask, sem="relaxed")
    if RSTATS:
        tl.atomic_max(rcolmax_ptr + cols, colmax_acc, mask=cmask, sem="relaxed")


def pick_tile(m: int, k: int) -> tuple[int, int, int, int]:
    """``(BM, BK, ROW_ITERS, num_warps)`` for small ``m`` (and every shape under the interpreter)."""
    if INTERP:
        return 8, 32, 2, 4
    bk = 128 if k >= 128 else 64
    return max(1, triton.next_power_of_2(min(m, 16))), bk, 1, 4


def big_configs():
    """Autotuning space for ``m > 64`` (memory-bound: bytes in flight per SM vs registers)."""
    return [
        triton.Config({"BM": bm, "BK": bk, "ROW_ITERS": ri, "STAGES": st}, num_warps=nw, num_stages=st)
        for bm, bk, ri, nw, st in ((16, 128, 4, 4, 3), (8, 256, 8, 4, 3), (32, 128, 4, 8, 2))
    ]


def _bench(fn, quantiles):
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


from qpass.backends.triton.tiles import pinned_tile  # noqa: E402 - tile selection only (autotune or pinned)

if not INTERP:
    _quant_tuned = triton.autotune(
        configs=big_configs(), key=["M_BUCKET", "K", "PER_ROW", "WRITE_CODES", "WRITE_XHAT", "SCORES", "RSTATS", "RABS", "WRITE_BX"],
        reset_to_zero=["scores_ptr", "rcolmax_ptr", "rrowmax_ptr"], do_bench=_bench,
    )(_nvfp4_quant_kernel)


def launch_nvfp4_quant(
    x, amax, per_row, *, codes=None, scales=None, xhat=None, bx=None, s_enc=None, s_dec=None,
    gamax_bits=None, log2m=0, scores=None, rcolmax=None, rrowmax=None, rabs=None, xhat_lim=BF16_MAX,
):
    """Launch the quantization kernel over ``x [M, K]`` (row stride ``x.stride(0)``, unit column stride).

    Every output is optional (pass None to skip it); see the module docstring for their meaning.
    ``xhat_lim``: bound of ``x_hat`` (and of the ``x_hat`` the residual statistics use), the
    ``act_operand_limit`` of ``x``'s dtype (65280 for fp16; default: the bf16 max).
    ``scores``/``rcolmax``/``rrowmax`` must be zero-initialised (they are accumulated atomically).
    ``bx``: bf16 ``[M, K]`` output of the GEMM operand ``B_X = e2m1 * s_b`` (SPEC §3.1).
    """
    import torch

    m, k = x.shape
    dummy = amax
    # unused atomic outputs get their own scratch word: the autotuner zeroes these arguments
    scratch = torch.zeros(1, dtype=torch.int64, device=x.device) if scores is None or rcolmax is None else None
    args = (
        x, x.stride(0), m, k, amax, float(xhat_lim),
        codes if codes is not None else dummy, scales if scales is not None else dummy,
        xhat if xhat is not None else dummy, bx if bx is not None else dummy,
        s_enc if s_enc is not None else dummy, s_dec if s_dec is not None else dummy,
        gamax_bits if gamax_bits is not None else dummy, log2m,
        scores if scores is not None else scratch, rcolmax if rcolmax is not None else scratch,
        rrowmax if rrowmax is not None else scratch, rabs if rabs is not None else dummy,
        min(triton.next_power_of_2(m), 1 << 16),
    )
    flags = dict(
        PER_ROW=per_row, WRITE_CODES=codes is not None, WRITE_XHAT=xhat is not None, WRITE_GLOBAL=s_enc is not None,
        SCORES=scores is not None, RSTATS=rcolmax is not None, RABS=rabs is not None, WRITE_BX=bx is not None,
        enable_fp_fusion=False,
    )
    launch_row_tiled(_nvfp4_quant_kernel, None if INTERP else _quant_tuned, "nvfp4_quant", args, flags, m, k,
                     PER_ROW=per_row, WRITE_CODES=codes is not None, WRITE_XHAT=xhat is not None, SCORES=scores is not None,
                     RSTATS=rcolmax is not None, RABS=rabs is not None)


def launch_row_tiled(kernel, tuned, tile_name, args, flags, m, k, **tile_key):
    """Launch a row-tiled ``[M, K]`` kernel of this family (``BM``/``BK``/``ROW_ITERS``/``STAGES``
    meta-parameters, grid ``(cdiv(M, BM*ROW_ITERS), cdiv(K, BK))``, ``args[-1]`` = ``M_BUCKET``).

    ``tuned``: the autotuned wrapper of ``kernel``, None under the interpreter. Without it or for
    ``m <= 64``: :func:`pick_tile`. Otherwise the pinned tile of ``tile_name`` for ``tile_key``
    (:func:`qpass.backends.triton.tiles.pinned_tile`) if there is one, else ``tuned``.
    """
    if tuned is None or m <= 64:
        bm, bk, row_iters, nw = pick_tile(m, k)
        grid = (triton.cdiv(m, bm * row_iters), triton.cdiv(k, bk))
        kernel[grid](*args, BM=bm, BK=bk, ROW_ITERS=row_iters, STAGES=1, num_warps=nw, **flags)
        return
    tile = pinned_tile(tile_name, M_BUCKET=args[-1], K=k, **tile_key)
    if tile is None:
        grid = lambda meta: (triton.cdiv(m, meta["BM"] * meta["ROW_ITERS"]), triton.cdiv(k, meta["BK"]))  # noqa: E731
        tuned[grid](*args, **flags)
    else:
        t = dict(tile.meta)
        kernel[(triton.cdiv(m, t["BM"] * t["ROW_ITERS"]), triton.cdiv(k, t["BK"]))](*args, **flags, **tile.kwargs())
