"""NVFP4-weight GEMV for decode (M <= 4 rows): ``y = fl(acc(x B_W^T) * alpha) (+ bias)`` on the CUDA cores.

Same operands and semantics as :mod:`.nvfp4_gemm` without the RAC second segment (SPEC §3.1, the
factored decode): packed E2M1 codes ``[N, K/2]`` (read as int32 words of 8 elements), E4M3
block-scale bytes ``[N, K/16]``; the weight is decoded in registers to the exact operand
``B = e2m1 * s_b`` (either the arithmetic decode or the ``lut`` table + byte permute decode of
:mod:`.nvfp4_gemm`, same bits), multiplied with the activation rows in IEEE float32
(``acc = fma(b, x, acc)``), and the per-tensor scales are applied once per output, ``alpha = S_dec_W``
or ``fl(S_dec_X * S_dec_W)`` (``xs``: the W4A4 operand's global scale, per tensor or per row). For
bf16 (and fp16) activations the product with ``B`` is exact in float32 (at most 14 / 17 significant
bits; barring underflow below float32's range), so the fused multiply-add rounds exactly like a
separate add of the exact product (what the tensor cores compute); fp32 activations are multiplied
as float32 (one rounding in the FMA, as in the GEMM's IEEE float32 dot).

Layout: a program owns ``BN`` weight rows and walks its split's K tiles; a tile is
``[BN, BK/8]`` int32 code words (16-byte loads). The 8 elements of a word are never interleaved
back into K order (no ``join``/``reshape``): element ``j`` of every word multiplies the activation
column ``8 w + j`` of the tile loaded for exactly that slot, so the decoded tile stays in the
registers that loaded its bytes. Each activation row has its own ``[BN, BK/8]`` float32 accumulator (one
``fma`` per element and row); the tile-wise sums are reduced once at the end. The next tile's code
words and scale bytes are loaded before the current tile is decoded (a register double buffer: two
tiles of weight bytes in flight per thread).

Summation order (deterministic, no atomics): each accumulator slot sums its products over the K
tiles of the split in K order, element ``j = 0..7`` of a word in turn; the slots are then reduced
by ``tl.reduce`` (a fixed tree for a given config), and split-K partials are added in split order
by :func:`.nvfp4_gemm._splitk_reduce_kernel` (which then applies ``alpha``). The GEMM's own order is not reproducible here (its
tile sums run inside the tensor cores, whose additions are not IEEE), so the contract is the
GEMM's: SPEC §3.1's ``|acc - exact| <= gamma_K * sum|a||b|`` (tests/test_factored_decode.py), bf16
output within one rounding step of the reference, decoded operands bit-identical (one-hot rows).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERP, e2m1_value, e4m3_value, row_alpha, rsum, to_out, ub
from .nvfp4_gemm import _LUT_DECODE_ASM, _LUT_TABLE_ASM, _splitk_reduce_kernel  # noqa: F401


@triton.jit
def _dec_ref(words, s, J: tl.constexpr):
    """The operand ``B = e2m1 * s_b`` (float32, exact) of element ``J`` (nibble ``J``) of every int32 code word."""
    c = (words >> (4 * J)) & 15
    return e2m1_value(c) * s


@triton.jit
def _x_col(x_row, kpos, kmask, J: tl.constexpr):
    """Activation values ``x[row, kpos + J]`` (float32) for one element slot of every word."""
    return tl.load(x_row + kpos + J, mask=kmask, other=0.0).to(tl.float32)


@triton.jit
def _fma8(acc, x_row, kpos, kmask, e0, e1, e2, e3, e4, e5, e6, e7):
    acc = tl.fma(e0, _x_col(x_row, kpos, kmask, 0), acc)
    acc = tl.fma(e1, _x_col(x_row, kpos, kmask, 1), acc)
    acc = tl.fma(e2, _x_col(x_row, kpos, kmask, 2), acc)
    acc = tl.fma(e3, _x_col(x_row, kpos, kmask, 3), acc)
    acc = tl.fma(e4, _x_col(x_row, kpos, kmask, 4), acc)
    acc = tl.fma(e5, _x_col(x_row, kpos, kmask, 5), acc)
    acc = tl.fma(e6, _x_col(x_row, kpos, kmask, 6), acc)
    acc = tl.fma(e7, _x_col(x_row, kpos, kmask, 7), acc)
    return acc


@triton.jit
def _fma8_pairs(acc, xp_row, ppos, kmask, e0, e1, e2, e3, e4, e5, e6, e7):
    """As :func:`_fma8` for bf16 rows read as int32 pairs (element 2i low half, 2i + 1 high half)."""
    p = tl.load(xp_row + ppos, mask=kmask, other=0)
    acc = tl.fma(e0, (p << 16).to(tl.float32, bitcast=True), acc)
    acc = tl.fma(e1, (p & -65536).to(tl.float32, bitcast=True), acc)
    p = tl.load(xp_row + ppos + 1, mask=kmask, other=0)
    acc = tl.fma(e2, (p << 16).to(tl.float32, bitcast=True), acc)
    acc = tl.fma(e3, (p & -65536).to(tl.float32, bitcast=True), acc)
    p = tl.load(xp_row + ppos + 2, mask=kmask, other=0)
    acc = tl.fma(e4, (p << 16).to(tl.float32, bitcast=True), acc)
    acc = tl.fma(e5, (p & -65536).to(tl.float32, bitcast=True), acc)
    p = tl.load(xp_row + ppos + 3, mask=kmask, other=0)
    acc = tl.fma(e6, (p << 16).to(tl.float32, bitcast=True), acc)
    acc = tl.fma(e7, (p & -65536).to(tl.float32, bitcast=True), acc)
    return acc


@triton.jit
def _per_word(v, BN: tl.constexpr, BK: tl.constexpr):
    """``[BN, BK/16]`` per-block values -> ``[BN, BK/8]``, each repeated for the block's two words."""
    return tl.reshape(tl.join(v, v), (BN, BK // 8))


@triton.jit
def _gemv_row(acc, m: tl.constexpr, x_ptr, stride_xm, M, kpos, kmask, e0, e1, e2, e3, e4, e5, e6, e7,
              MASK_K: tl.constexpr, X_PAIRS: tl.constexpr):
    """``acc += sum_j e_j * x[m, kpos + j]`` for activation row ``m`` (masked off when ``m >= M``)."""
    # (M + zeros) > m, not broadcast_to(M > m): were M a compile-time 1 (Triton specializes integer
    # arguments equal to 1), ``M > m`` would be a Python bool, which broadcast_to rejects
    rm = (tl.full(kpos.shape, 0, tl.int32) + M) > m
    if MASK_K:
        rm = rm & kmask
    if X_PAIRS:
        xr = x_ptr.to(tl.pointer_type(tl.int32)) + m * (stride_xm // 2)
        return _fma8_pairs(acc, xr, kpos // 2, rm, e0, e1, e2, e3, e4, e5, e6, e7)
    else:
        return _fma8(acc, x_ptr + m * stride_xm, kpos, rm, e0, e1, e2, e3, e4, e5, e6, e7)


@triton.jit
def _gemv_tile(acc0, acc1, acc2, acc3, x_ptr, stride_xm, M, w_base, s_base, k0, K, nmask, kb, kw, words_in,
               s_in, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MASK_K: tl.constexpr, LUT: tl.constexpr,
               X_PAIRS: tl.constexpr, PRELOADED: tl.constexpr):
    """One K tile at ``k0``: decode its ``[BN, BK/8]`` code words once (loaded here, or already in
    ``words_in`` / ``s_in`` with ``PRELOADED``), ``fma`` them into the accumulator of each of the
    ``BM`` activation rows."""
    kpos = k0 + kw * 8  # first K column of every word  [BK/8]
    if MASK_K:
        kmask = kpos < K
        wmask = nmask[:, None] & kmask[None, :]
        smask = nmask[:, None] & ((k0 + kb * 16) < K)[None, :]
    else:
        wmask = nmask[:, None]
        smask = nmask[:, None]
        kmask = None
    if PRELOADED:
        words = words_in
    else:
        words = tl.load(w_base + k0 // 8, mask=wmask, other=0)
    # one scale byte (and, with LUT, one 4-register table) per 16-element block, duplicated in
    # registers to the block's two words (``join`` + ``reshape``: both copies land in the thread
    # that holds both words, so there is no shared-memory layout conversion)
    if PRELOADED:
        s_raw = s_in
    else:
        s_raw = tl.load(s_base + k0 // 16, mask=smask, other=0)
    s2 = e4m3_value(s_raw.to(tl.int32))  # [BN, BK/16]
    if LUT:
        t0, t1, t2, t3 = tl.inline_asm_elementwise(
            _LUT_TABLE_ASM, "=r,=r,=r,=r,f,f", [s2, tl.full(s2.shape, 1.0, tl.float32)],  # global 1.0: the table is B
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )
        b0, b1, b2, b3, b4, b5, b6, b7 = tl.inline_asm_elementwise(
            _LUT_DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
            [words, _per_word(t0, BN, BK), _per_word(t1, BN, BK), _per_word(t2, BN, BK), _per_word(t3, BN, BK)],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
        )
        e0, e1, e2, e3 = b0.to(tl.float32), b1.to(tl.float32), b2.to(tl.float32), b3.to(tl.float32)
        e4, e5, e6, e7 = b4.to(tl.float32), b5.to(tl.float32), b6.to(tl.float32), b7.to(tl.float32)
    else:
        sf = _per_word(s2, BN, BK)
        e0, e1, e2, e3 = _dec_ref(words, sf, 0), _dec_ref(words, sf, 1), _dec_ref(words, sf, 2), _dec_ref(words, sf, 3)
        e4, e5, e6, e7 = _dec_ref(words, sf, 4), _dec_ref(words, sf, 5), _dec_ref(words, sf, 6), _dec_ref(words, sf, 7)
    acc0 = _gemv_row(acc0, 0, x_ptr, stride_xm, M, kpos, kmask, e0, e1, e2, e3, e4, e5, e6, e7, MASK_K, X_PAIRS)
    if BM > 1:
        acc1 = _gemv_row(acc1, 1, x_ptr, stride_xm, M, kpos, kmask, e0, e1, e2, e3, e4, e5, e6, e7, MASK_K, X_PAIRS)
    if BM > 2:
        acc2 = _gemv_row(acc2, 2, x_ptr, stride_xm, M, kpos, kmask, e0, e1, e2, e3, e4, e5, e6, e7, MASK_K, X_PAIRS)
        acc3 = _gemv_row(acc3, 3, x_ptr, stride_xm, M, kpos, kmask, e0, e1, e2, e3, e4, e5, e6, e7, MASK_K, X_PAIRS)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_out(acc, m, M, N, ncols64, nmask, bias_ptr, out_ptr, stride_om, ws_ptr, pid_k, sdec, xs_ptr,
              SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr, XS: tl.constexpr):
    """Row ``m``'s output: ``fl(sum * alpha) (+ bias)`` (SPEC §3.1), or its raw partial under split-K."""
    y = rsum(acc, 1)  # [BN]
    omask = nmask & ((tl.full(nmask.shape, 0, tl.int32) + M) > m)
    if SPLIT_K == 1:
        rm = tl.full(ncols64.shape, 0, tl.int32) + m
        y = y * row_alpha(xs_ptr, rm, omask, sdec, XS)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + ncols64, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + ncols64, to_out(y, OUT_DTYPE), mask=omask)
    else:
        tl.store(ws_ptr + (pid_k.to(tl.int64) * M + m) * N + ncols64, y, mask=omask)


@triton.jit  # M = 1 is specialized by Triton (a compile-time 1): the body compiles either way (aot pins it)
def _nvfp4_gemv_kernel(
    x_ptr, stride_xm,
    w_codes_ptr, stride_wn, w_scales_ptr, stride_sn, w_sdec_ptr, xs_ptr,
    bias_ptr, out_ptr, stride_om, ws_ptr,
    M, N, K, M_BUCKET,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr, DECODE: tl.constexpr, X_PAIRS: tl.constexpr, XS: tl.constexpr,
):
    """``BM`` (1, 2 or 4; rows ``>= M`` masked) activation rows x ``BN`` weight rows, K tiles
    ``pid_k, pid_k + SPLIT_K, ...`` of ``BK`` columns (the ragged last tile masked by 16-blocks)."""
    LUT: tl.constexpr = (DECODE == 1) and (not INTERP)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ncols = pid_n * BN + tl.arange(0, BN)
    nmask = ncols < N
    ncols64 = ncols.to(tl.int64)
    kw = tl.arange(0, BK // 8)  # code words (8 elements) of a tile
    w_base = w_codes_ptr.to(tl.pointer_type(tl.int32)) + ncols64[:, None] * (stride_wn // 4) + kw[None, :]
    kb = tl.arange(0, BK // 16)  # 16-element blocks of a tile
    s_base = w_scales_ptr + ncols64[:, None] * stride_sn + kb[None, :]
    sdec = tl.load(w_sdec_ptr)
    acc0 = tl.full((BN, BK // 8), 0.0, tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    k_full = (K // BK) * BK
    step: tl.constexpr = BK * SPLIT_K  # a constexpr: a plain local would be a 1-element array under the interpreter
    # full tiles, the next tile's code words and scale bytes loaded (register double buffer) before
    # this tile is decoded: two tiles of weight bytes in flight per thread instead of one
    k_first = pid_k * BK
    words = tl.load(w_base + k_first // 8, mask=nmask[:, None] & (k_first < k_full), other=0)
    s_raw = tl.load(s_base + k_first // 16, mask=nmask[:, None] & (k_first < k_full), other=0)
    for k0 in tl.range(ub(k_first), ub(k_full), step):
        kn = k0 + step
        words_n = tl.load(w_base + kn // 8, mask=nmask[:, None] & (kn < k_full), other=0)
        s_n = tl.load(s_base + kn // 16, mask=nmask[:, None] & (kn < k_full), other=0)
        acc0, acc1, acc2, acc3 = _gemv_tile(acc0, acc1, acc2, acc3, x_ptr, stride_xm, M, w_base, s_base, k0, K, nmask,
                                            kb, kw, words, s_raw, BM, BN, BK, False, LUT, X_PAIRS, True)
        words = words_n
        s_raw = s_n
    if k_full < K:  # the ragged last tile (whole 16-blocks masked)
        if (k_full // BK) % SPLIT_K == pid_k:
            acc0, acc1, acc2, acc3 = _gemv_tile(acc0, acc1, acc2, acc3, x_ptr, stride_xm, M, w_base, s_base, k_full, K,
                                                nmask, kb, kw, words, s_raw, BM, BN, BK, True, LUT, X_PAIRS, False)
    _gemv_out(acc0, 0, M, N, ncols64, nmask, bias_ptr, out_ptr, stride_om, ws_ptr, pid_k, sdec, xs_ptr, SPLIT_K, HAS_BIAS,
              OUT_DTYPE, XS)
    if BM > 1:
        _gemv_out(acc1, 1, M, N, ncols64, nmask, bias_ptr, out_ptr, stride_om, ws_ptr, pid_k, sdec, xs_ptr, SPLIT_K,
                  HAS_BIAS, OUT_DTYPE, XS)
    if BM > 2:
        _gemv_out(acc2, 2, M, N, ncols64, nmask, bias_ptr, out_ptr, stride_om, ws_ptr, pid_k, sdec, xs_ptr, SPLIT_K,
                  HAS_BIAS, OUT_DTYPE, XS)
        _gemv_out(acc3, 3, M, N, ncols64, nmask, bias_ptr, out_ptr, stride_om, ws_ptr, pid_k, sdec, xs_ptr, SPLIT_K,
                  HAS_BIAS, OUT_DTYPE, XS)


# --- launcher ----------------------------------------------------------------------------------
MAX_M = 4  # the GEMV serves M = 1..MAX_M rows (BM = 1, 2, 4)
SPLIT_BN = 8  # weight rows per program when K is split


# (BN weight rows, BK columns, warps): 2-4 code words (16-32 weight elements) per thread and tile.
# Checked in the sm_90 compile (``python -m qpass.apps.bench.aot --full --filter gemv``,
# ``tests/test_triton_aot.py``): no spills, and no shared memory in the K loop - the scale bytes land
# in the threads that hold their words. Not every tile has that property: 4 x 512 on 2 warps,
# 4 x 256 on 1 and 4 x 1024 on 4 convert a tile through shared memory every iteration; at 8 words
# per thread the 2- and 4-row variants spill. Few candidates on purpose: each is compiled per
# (BM, decode, bias, output dtype) variant the first time a shape is seen.
TILES = ((4, 512, 4), (8, 256, 2), (8, 512, 4), (16, 512, 8))


def _configs(fixed_bn: bool):
    """Autotune candidates (:data:`TILES`); under split-K ``BN`` is fixed to ``SPLIT_BN`` by the
    launcher (the workspace and grid depend on it)."""
    cfgs = []
    for bn, bk, nw in TILES:
        if fixed_bn and bn != SPLIT_BN:
            continue
        kw = {"BK": bk} if fixed_bn else {"BN": bn, "BK": bk}
        cfgs.append(triton.Config(kw, num_warps=nw, num_stages=1))
    return cfgs


def fixed_tile() -> tuple[int, int, int] | None:
    """``QPASS_NVFP4_GEMV_TILE=BN,BK,WARPS`` pins the GEMV tile (no autotuning; e.g. the pick recorded
    in ``bench.json`` ``meta.autotune``); unset: autotune over :data:`TILES`."""
    import os

    v = os.environ.get("QPASS_NVFP4_GEMV_TILE")
    if not v:
        return None
    bn, bk, nw = (int(t) for t in v.split(","))
    if bk % 16 or bk < 16 or bn < 1 or nw < 1:
        raise ValueError(f"QPASS_NVFP4_GEMV_TILE must be BN,BK,WARPS with BK a multiple of 16, got {v!r}")
    return bn, bk, nw


def _bench(fn, quantiles):
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


from qpass.backends.triton.tiles import pinned_tile  # noqa: E402 - tile selection only (autotune or pinned)

if not INTERP:
    _KEY = ["M_BUCKET", "N", "K", "SPLIT_K", "DECODE", "X_PAIRS", "HAS_BIAS"]
    _gemv_auto = triton.autotune(configs=_configs(False), key=_KEY, do_bench=_bench)(_nvfp4_gemv_kernel)
    _gemv_split = triton.autotune(configs=_configs(True), key=_KEY + ["BN"], do_bench=_bench)(_nvfp4_gemv_kernel)



def gemv_split(n: int, k: int, num_sms: int) -> int:
    """K splits of the GEMV: 1 unless ``SPLIT_BN``-row programs leave most SMs idle and K is long
    (then up to 8 splits of >= 2048 columns, partials added in split order by a second kernel)."""
    tiles = triton.cdiv(n, SPLIT_BN)
    if tiles >= num_sms // 2 or k < 4096:
        return 1
    return max(1, min(8, 1 << ((num_sms // tiles).bit_length() - 1), 1 << ((k // 2048).bit_length() - 1)))


# ``auto`` routing measured on the H200 (docs/results/h200/gemv/bench_gemv.json, 2026-12-03): time(old
# GEMM path) / time(GEMV) at M = 1 / 2 / 4 was 1.53 / 1.14 / 0.83 on the Llama-8B shapes (N x K >= 16.8M
# weights) and 2.05 / 2.24 / 1.88 on the SmolLM2 shapes (<= 0.9M): large weights take the GEMV up to
# M = 2 only. ``on`` / ``gemv=True`` still serve every M <= MAX_M.
AUTO_LARGE_NK = 1 << 22
AUTO_MAX_M_LARGE = 2


def gemv_auto_max_m(n: int, k: int) -> int:
    """Most rows the ``auto`` route sends to the GEMV for an ``[n, k]`` weight (see the table above)."""
    return AUTO_MAX_M_LARGE if n * k > AUTO_LARGE_NK else MAX_M


def gemv_supported(a, w_codes) -> bool:
    """Whether :func:`launch_nvfp4_gemv` can serve this call: 1..MAX_M rows, unit column stride,
    code rows readable as aligned int32 words (``K % 16 == 0``, 4-byte aligned base)."""
    m, k = a.shape
    return (1 <= m <= MAX_M and k % 16 == 0 and a.stride(1) == 1 and w_codes.stride(0) % 8 == 0
            and w_codes.data_ptr() % 4 == 0)


def launch_nvfp4_gemv(a, w_codes, w_scales, w_sdec, out, *, bias=None, num_sms=132, decode="ref", split_k=None,
                      bn=None, bk=None, num_warps=None, xs=None):
    """``out [M, N] = fl(acc(a B_W^T) * alpha) (+ bias)`` for ``M <= MAX_M`` (see :func:`gemv_supported`;
    SPEC §3.1: ``alpha = S_dec_W``, or ``fl(S_dec_X * S_dec_W)`` with ``xs`` = ``S_dec_X`` ``[1]`` / ``[M]``).

    Args:
        a: bf16 / fp16 / fp32 ``[M, K]``, unit column stride.
        w_codes, w_scales: uint8 ``[N, K/2]`` / ``[N, K/16]`` (row-contiguous); w_sdec float32 ``[1]``.
        out: ``[M, N]`` (bf16/fp16/fp32), unit column stride.
        bias: optional ``[N]``.
        decode: ``"ref"`` / ``"lut"`` (:func:`.nvfp4_gemm.default_decode`; same bits).
        split_k, bn, bk, num_warps: fixed launch shape (tests, experiments); default: the heuristic
            split (:func:`gemv_split`) and the autotuned tile on the GPU, a small tile under the
            interpreter.
    """
    import torch

    from .nvfp4_gemm import DECODES, _out_tl_dtype, scale_mode

    m, k = a.shape
    n = w_codes.shape[0]
    if not gemv_supported(a, w_codes):
        raise ValueError(f"GEMV needs 1..{MAX_M} rows, K % 16 == 0 and aligned int32 code rows; got {tuple(a.shape)}")
    bm = 1 if m == 1 else (2 if m == 2 else 4)
    x_pairs = a.dtype == torch.bfloat16 and a.stride(0) % 2 == 0 and a.data_ptr() % 4 == 0
    dec = DECODES[decode]
    out_dt = _out_tl_dtype(out.dtype)
    dummy = w_sdec
    split = split_k or (1 if INTERP else gemv_split(n, k, num_sms))
    pinned = None if (INTERP or bn is not None or bk is not None) else fixed_tile()
    if pinned is None and not (INTERP or bn is not None or bk is not None):  # tiles.py: pinned mode, no timing
        rule = pinned_tile("gemv" if split == 1 else "gemv_split", M_BUCKET=bm, N=n, K=k, SPLIT_K=split, DECODE=dec,
                           X_PAIRS=x_pairs, HAS_BIAS=bias is not None)
        if rule is not None:
            t = dict(rule.meta)
            pinned = (t.get("BN", SPLIT_BN), t["BK"], rule.num_warps)
    if pinned is not None:
        bn, bk, num_warps = pinned[0] if split == 1 else SPLIT_BN, pinned[1], pinned[2]
    fixed = INTERP or bn is not None or bk is not None
    if INTERP:
        bn, bk, num_warps = bn or 8, bk or 64, num_warps or 1
    elif fixed:
        bn = bn or 8
    elif split > 1:
        bn = bn or SPLIT_BN
    ws = torch.empty(split, m, n, dtype=torch.float32, device=a.device) if split > 1 else dummy
    xs_mode = scale_mode(xs, m)
    args = (a, a.stride(0), w_codes, w_codes.stride(0), w_scales, w_scales.stride(0), w_sdec,
            xs if xs is not None else dummy, bias if bias is not None else dummy, out, out.stride(0), ws, m, n, k, bm)
    common = dict(BM=bm, SPLIT_K=split, HAS_BIAS=bias is not None, OUT_DTYPE=out_dt, DECODE=dec, X_PAIRS=x_pairs,
                  XS=xs_mode, enable_fp_fusion=False)
    if fixed:
        grid = (triton.cdiv(n, bn), split)
        _nvfp4_gemv_kernel[grid](*args, BN=bn, BK=bk or 512, num_warps=num_warps or 4, num_stages=1, **common)
    elif split > 1:
        _gemv_split[(triton.cdiv(n, bn), split)](*args, BN=bn, **common)
    else:
        _gemv_auto[lambda meta: (triton.cdiv(n, meta["BN"]), 1)](*args, **common)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, bias if bias is not None else dummy, out, out.stride(0), m, n, w_sdec, xs if xs is not None else dummy,
            dummy, SPLIT_K=split, HAS_BIAS=bias is not None, OUT_DTYPE=out_dt, BLOCK=block, SEG2=0, XS=xs_mode, RS=0,
            num_warps=4, enable_fp_fusion=False,
        )
