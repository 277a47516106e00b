"""MXFP4 quantization kernel (port of ``qpass.quant.mxfp4.mxfp4_quantize``, OCP MX v1.0 §6.3).

Per block of 32 along K: ``e = floor(log2 vmax) - 2`` read from the float32 exponent (exact at
powers of two), clamped to ``[-127, 127]`` (all-zero block: -127); scale byte ``e + 127``;
element ``e2m1_rne(clamp(fl(x * 2^-e), -6, 6))``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERP, e2m1_index, frexp_exp, load_tile_f32, pack_nibbles, rmax


@triton.jit
def _mxfp4_quant_kernel(x_ptr, stride_xm, M, K, codes_ptr, scales_ptr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    x, rmask, mask, rows64 = load_tile_f32(x_ptr, stride_xm, rows, cols, M, K)
    x3 = tl.reshape(x, (BM, BK // 32, 32))
    vmax = rmax(tl.abs(x3), 2)
    e = tl.where(vmax > 0.0, frexp_exp(tl.where(vmax > 0.0, vmax, 1.0)) - 1 - 2, -127)
    e = tl.minimum(tl.maximum(e, -127), 127)
    ne = -e  # 2^ne, ne in [-127, 127]; 2^-127 is the float32 subnormal 0x00400000
    normal = ((tl.maximum(ne, -126) + 127) << 23).to(tl.float32, bitcast=True)
    inv = tl.where(ne >= -126, normal, 5.877471754111438e-39)  # 2^-127 (float32 subnormal, exact)
    y = tl.minimum(tl.maximum(x3 * inv[:, :, None], -6.0), 6.0)
    codes3 = e2m1_index(tl.abs(y)) | ((y < 0.0).to(tl.int32) << 3)
    bcols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    tl.store(codes_ptr + rows64[:, None] * (K // 2) + bcols[None, :], pack_nibbles(tl.reshape(codes3, (BM, BK)), BM, BK),
             mask=rmask[:, None] & (bcols[None, :] < K // 2))
    scols = pid_k * (BK // 32) + tl.arange(0, BK // 32)
    tl.store(scales_ptr + rows64[:, None] * (K // 32) + scols[None, :], (e + 127).to(tl.uint8),
             mask=rmask[:, None] & (scols[None, :] < K // 32))


def launch_mxfp4_quant(x, codes, scales):
    """``x [M, K]`` (K % 32 == 0) -> codes uint8 ``[M, K/2]``, E8M0 scale bytes ``[M, K/32]``."""
    m, k = x.shape
    bm, bk = (8, 64) if INTERP else (16, 128)
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _mxfp4_quant_kernel[grid](x, x.stride(0), m, k, codes, scales, BM=bm, BK=bk, num_warps=4, enable_fp_fusion=False)
