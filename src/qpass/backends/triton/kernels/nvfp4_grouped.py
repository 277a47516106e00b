"""Grouped NVFP4-weight GEMM over MoE experts: tokens sorted by expert, one launch for all experts.

``out[r] = fl(acc(A[r] B[e(r)]^T) * alpha[r]) (+ fl(acc(A2[r] B[e(r)]^T) * alpha_R[r]))`` for every
row ``r`` of the sorted token operand (SPEC §3.1), where rows ``offs[e] .. offs[e+1]`` belong to
expert ``e`` and ``B[e] = e2m1 * s_b`` is decoded in registers from expert ``e``'s packed E2M1 codes
``[E, N, K/2]`` and E4M3 scale bytes ``[E, N, K/16]`` exactly as :mod:`.nvfp4_gemm` decodes one weight
(it reuses that module's ``_dense_segment``: same decode, same two-level accumulation); ``alpha[r] =
fl(S_dec_X[r] * S_dec_W[e])`` with each row's activation scale (each expert's own dynamic one). ``A2``
is RAC's dense (masked-mode) compensation operand ``B_R`` with its own accumulator and scale.

A program computes one ``BN x BM`` tile of one expert: the host builds the tile list (expert id,
first row) so a tile never spans two experts. Tiles are independent and every output element's
float32 sum runs over K in the same order whatever the other experts hold, so the grouped launch
equals, bit for bit, each expert launched alone with the same tile parameters (``tests/test_moe.py``,
``scripts/gpu_moe.sh``). One fixed tile configuration (no autotune, no split-K).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERP, row_alpha, to_out
from .nvfp4_gemm import _dense_segment


@triton.jit
def _grouped_kernel(
    a_ptr, stride_am, a2_ptr, stride_a2m,
    w_codes_ptr, stride_ce, stride_cn, w_scales_ptr, stride_se, stride_sn, w_sdec_ptr, xs_ptr, rs_ptr,
    tile_expert_ptr, tile_row_ptr, offs_ptr, out_ptr, stride_om, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, TWO: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PROMOTE_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    r0 = tl.load(tile_row_ptr + pid_t)
    end = tl.load(offs_ptr + e + 1)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < end
    ncols = pid_n * BN + tl.arange(0, BN)
    nmask = ncols < N
    ncols64 = ncols.to(tl.int64)
    e64 = e.to(tl.int64)
    sdec = tl.load(w_sdec_ptr + e)
    acc = tl.full((BN, BM), 0.0, tl.float32)
    if TWO:
        acc2 = tl.full((BN, BM), 0.0, tl.float32)
    else:
        acc2 = tl.full((1, 1), 0.0, tl.float32)
    acc, acc2 = _dense_segment(acc, acc2, a_ptr, stride_am, a2_ptr, stride_a2m, K, rows, rmask, w_codes_ptr + e64 * stride_ce,
                               stride_cn, w_scales_ptr + e64 * stride_se, stride_sn, ncols64, nmask, 0, 1, False, BM, BN,
                               BK, STAGES, 0, TWO, PROMOTE_K)
    # SPEC §3.1 epilogue: alpha = fl(S_dec_X[row] * S_dec_W[e]) (S_dec_X per row: each expert's own scale)
    y = acc * row_alpha(xs_ptr, rows, rmask, sdec, 2)[None, :]
    if TWO:
        y = y + acc2 * row_alpha(rs_ptr, rows, rmask, sdec, 2)[None, :]
    omask = nmask[:, None] & rmask[None, :]
    rows64 = rows.to(tl.int64)
    tl.store(out_ptr + rows64[None, :] * stride_om + ncols64[:, None], to_out(y, OUT_DTYPE), mask=omask)


def tile_params() -> dict:
    """The fixed tiles: the interpreter uses the per-site kernel's interpreter tiles (16 x 32 x 64,
    two-tile promotion), the GPU 64-token x 64-row x 128-K tiles promoted every K tile."""
    if INTERP:
        return {"BM": 16, "BN": 32, "BK": 64, "STAGES": 1, "PROMOTE_K": 128, "num_warps": 4}
    return {"BM": 64, "BN": 64, "BK": 128, "STAGES": 3, "PROMOTE_K": 128, "num_warps": 4}


def launch_grouped(a, w_codes, w_scales, w_sdec, offs, out, *, xs, a2=None, rs=None, params=None):
    """``out [M, N] = fl(acc(a B_W[e]^T) * alpha) (+ fl(acc(a2 B_W[e]^T) * alpha_R))`` per sorted row
    (SPEC §3.1; ``alpha = fl(xs[row] * S_dec_W[e])``).

    Args:
        a: bf16 ``[M, K]`` ``B_X`` (rows of expert ``e`` at ``offs[e] .. offs[e+1]``), unit column stride.
        w_codes, w_scales: uint8 ``[E, N, K/2]`` / ``[E, N, K/16]`` (contiguous); w_sdec float32 ``[E]``.
        offs: int64 host list or tensor ``[E + 1]`` of segment starts (``offs[0] = 0``, ``offs[E] = M``).
        out: ``[M, N]`` bf16/fp16/fp32.
        xs: float32 ``[M]``: each row's activation global scale ``S_dec_X``.
        a2: optional bf16 ``[M, K]`` dense RAC operand ``B_R``; rs: float32 ``[M]`` its ``S_dec_R``.
        params: tile parameters (default :func:`tile_params`).
    """
    import torch

    from .nvfp4_gemm import _out_tl_dtype

    p = dict(params or tile_params())
    bm = p["BM"]
    offs_l = [int(v) for v in (offs.tolist() if hasattr(offs, "tolist") else offs)]
    te, tr = [], []
    for e in range(len(offs_l) - 1):
        for r in range(offs_l[e], offs_l[e + 1], bm):
            te.append(e)
            tr.append(r)
    if not te:
        return out
    dev = a.device
    tile_e = torch.tensor(te, dtype=torch.int32, device=dev)
    tile_r = torch.tensor(tr, dtype=torch.int32, device=dev)
    offs_t = torch.tensor(offs_l, dtype=torch.int32, device=dev)
    n, k = w_codes.shape[1], a.shape[1]
    grid = (triton.cdiv(n, p["BN"]), len(te))
    a2_ = a2 if a2 is not None else a
    nw = p.pop("num_warps")
    _grouped_kernel[grid](
        a, a.stride(0), a2_, a2_.stride(0), w_codes, w_codes.stride(0), w_codes.stride(1), w_scales, w_scales.stride(0),
        w_scales.stride(1), w_sdec, xs, rs if rs is not None else xs, tile_e, tile_r, offs_t, out, out.stride(0), n, k,
        TWO=a2 is not None,
        OUT_DTYPE=_out_tl_dtype(out.dtype), num_warps=nw, enable_fp_fusion=False, **p,
    )
    return out
