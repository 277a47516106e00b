"""FP8 E4M3 kernels: quantization (``qpass.quant.fp8.fp8_quantize``) and a block-scaled GEMM.

Quantization: ``scale = fl(amax/448)`` (``zero_amax_scale`` when that is 0), ``inv =
min(fl(1/scale), FLT_MAX)``, element ``e4m3_rne_satfinite(fl(x * inv))`` via the integer-bit E4M3
rounding; bytes stored as uint8. Granularities: per tensor / per token (amax given), 1x128 and
128x128 blocks (amax of the tile, partial edge blocks allowed).

GEMM: ``acc += (A_blk @ W_blk^T) * sa * sw`` per 128-wide K block, float32 accumulator. ``DOT_FP8``
uses the FP8 tensor cores (Hopper accumulates FP8 products with reduced internal precision);
otherwise both operands are upcast to bf16 in registers (exact for E4M3) and multiplied on the bf16
tensor cores with a float32 accumulator.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import FLT_MAX, INTERP, dot_acc, e4m3_byte, e4m3_round_mag, e4m3_value, load_tile_f32, rmax, to_out, ub


@triton.jit
def _fp8_quant_kernel(
    x_ptr, stride_xm, M, K, amax_ptr, zero_scale,
    data_ptr, scale_ptr, s_stride0, s_stride1,
    BM: tl.constexpr, BK: tl.constexpr, GRAN: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # GRAN: 0 per tensor (amax [1]), 1 per token (amax [M]), 2 block 1xBK (BLOCK_ROWS=1) or BMxBK.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    x, rmask, mask, rows64 = load_tile_f32(x_ptr, stride_xm, rows, cols, M, K)
    if GRAN == 0:
        amax = tl.full((BM,), 0.0, tl.float32) + tl.load(amax_ptr)
    elif GRAN == 1:
        amax = tl.load(amax_ptr + rows, mask=rmask, other=0.0)
    else:
        amax = rmax(tl.abs(x), 1)
        if BLOCK_ROWS > 1:
            amax = tl.full((BM,), 0.0, tl.float32) + rmax(amax, 0)
    scale = tl.div_rn(amax, tl.full((BM,), 448.0, tl.float32))
    scale = tl.where(scale == 0.0, zero_scale, scale)
    inv = tl.minimum(tl.div_rn(tl.full((BM,), 1.0, tl.float32), scale), FLT_MAX)
    y = x * inv[:, None]
    mag = e4m3_round_mag(tl.abs(y))
    # sign from y < 0 (a negative value that rounds to 0 keeps the sign: byte 0x80, like the
    # reference's where(x < 0, -mag, mag)); built with bits because Triton's unary minus is 0 - x.
    byte = e4m3_byte(mag) | ((y < 0.0).to(tl.int32) << 7)
    tl.store(data_ptr + rows64[:, None] * K + cols[None, :], byte.to(tl.uint8), mask=mask)
    if GRAN == 0:
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_ptr, rmax(scale, 0))
    elif GRAN == 1:
        if pid_k == 0:
            tl.store(scale_ptr + rows * s_stride0, scale, mask=rmask)
    else:
        if BLOCK_ROWS > 1:
            tl.store(scale_ptr + pid_m * s_stride0 + pid_k * s_stride1, rmax(scale, 0))
        else:
            tl.store(scale_ptr + rows * s_stride0 + pid_k * s_stride1, scale, mask=rmask)


def launch_fp8_quant(x, amax, zero_scale, data, scale, gran: int, block_rows: int):
    """Quantize ``x [M, K]`` into ``data`` (uint8 ``[M, K]``) and float32 ``scale``.

    ``gran``: 0 per tensor (``amax`` float32 [1]), 1 per token (``amax`` [M]), 2 blocks of
    ``block_rows x 128`` (``amax`` ignored).
    """
    m, k = x.shape
    if gran == 2:
        bk = 128
        bm = block_rows if block_rows > 1 else (8 if INTERP else 16)
    else:
        bk = 64 if INTERP else 128
        bm = 8 if INTERP else 16
    s0 = scale.stride(0) if scale.dim() >= 1 else 0
    s1 = scale.stride(1) if scale.dim() >= 2 else 0
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _fp8_quant_kernel[grid](
        x, x.stride(0), m, k, amax if amax is not None else scale, float(zero_scale), data, scale, s0, s1,
        BM=bm, BK=bk, GRAN=gran, BLOCK_ROWS=block_rows, num_warps=4 if bm * bk <= 4096 else 8,
        enable_fp_fusion=False,
    )


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, sa_ptr, sa_s0, sa_s1, w_ptr, sw_ptr, sw_s0, sw_s1, bias_ptr, out_ptr, stride_om,
    M, N, K, M_BUCKET,
    A_BR: tl.constexpr, W_BR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    ncols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < M
    nmask = ncols < N
    rows64 = rows.to(tl.int64)
    ncols64 = ncols.to(tl.int64)
    ka = tl.arange(0, BK)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, ub(K), BK):
        kk = k0 + ka
        kmask = kk < K
        a = tl.load(a_ptr + rows64[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0)
        w = tl.load(w_ptr + ncols64[:, None] * K + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        kb = k0 // BK
        sa = tl.load(sa_ptr + (rows // A_BR) * sa_s0 + kb * sa_s1, mask=rmask, other=0.0)
        sw = tl.load(sw_ptr + (ncols // W_BR) * sw_s0 + kb * sw_s1, mask=nmask, other=0.0)
        zero = tl.full((BM, BN), 0.0, tl.float32)
        if DOT_FP8:
            p = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(w.to(tl.float8e4nv, bitcast=True)), zero)
        else:
            av = e4m3_value(a.to(tl.int32)).to(tl.bfloat16)
            wv = e4m3_value(w.to(tl.int32)).to(tl.bfloat16)
            p = dot_acc(av, tl.trans(wv), zero)
        acc += (p * sa[:, None]) * sw[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + ncols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_om + ncols64[None, :], to_out(acc, OUT_DTYPE), mask=rmask[:, None] & nmask[None, :])


def _fp8_configs():
    return [
        triton.Config({"BM": bm, "BN": bn}, num_warps=nw, num_stages=ns)
        for bm, bn, nw, ns in ((64, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 4), (128, 256, 8, 3))
    ]


from qpass.backends.triton.tiles import pinned_tile  # noqa: E402 - tile selection only (autotune or pinned)

if not INTERP:
    _fp8_gemm_tuned = triton.autotune(
        configs=_fp8_configs(), key=["M_BUCKET", "N", "K", "DOT_FP8"],
        do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles),
    )(_fp8_gemm_kernel)


def launch_fp8_gemm(a, sa, a_br, w, sw, w_br, out, *, bias=None, dot_fp8=True):
    """``out [M, N] = (a * sa) @ (w * sw)^T (+ bias)`` for uint8 E4M3 bytes ``a [M, K]``, ``w [N, K]``.

    ``sa``/``sw`` float32 scales of any granularity, addressed as ``scale[row // BR, k // 128]``
    through their strides (per tensor: 0-dim; per token: ``[R, 1]``; blocks: ``[R/BR, K/128]``).
    """
    from .nvfp4_gemm import _out_tl_dtype

    m, k = a.shape
    n = w.shape[0]

    def strides(s, br):
        if s.dim() == 0:
            return 0, 0
        return (s.stride(0), s.stride(1) if s.shape[1] > 1 else 0)

    sa0, sa1 = strides(sa, a_br)
    sw0, sw1 = strides(sw, w_br)
    a_br = max(1, a_br)
    w_br = max(1, w_br)
    dummy = sa
    args = (a, sa, sa0, sa1, w, sw, sw0, sw1, bias if bias is not None else dummy, out, out.stride(0), m, n, k,
            min(triton.next_power_of_2(m), 4096))
    meta = dict(A_BR=a_br, W_BR=w_br, BK=128, HAS_BIAS=bias is not None, OUT_DTYPE=_out_tl_dtype(out.dtype))
    if INTERP:
        grid = (triton.cdiv(n, 32), triton.cdiv(m, 16))
        _fp8_gemm_kernel[grid](*args, BM=16, BN=32, DOT_FP8=False, num_warps=4, **meta)
    else:
        tile = pinned_tile("fp8_gemm", M_BUCKET=args[-1], N=n, K=k, DOT_FP8=dot_fp8)
        if tile is None:
            grid = lambda mt: (triton.cdiv(n, mt["BN"]), triton.cdiv(m, mt["BM"]))  # noqa: E731
            _fp8_gemm_tuned[grid](*args, DOT_FP8=dot_fp8, **meta)
        else:
            t = dict(tile.meta)
            _fp8_gemm_kernel[(triton.cdiv(n, t["BN"]), triton.cdiv(m, t["BM"]))](*args, DOT_FP8=dot_fp8, **meta, **tile.kwargs())
