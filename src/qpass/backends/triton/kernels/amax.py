"""max|x| reductions (exact: abs and max never round).

Per tensor: every program reduces a ``[BM, BK]`` tile and combines with ``atomic_max`` on the int32
bit pattern of ``|x|`` (non-negative float32 bit patterns order like their values, and integer max is
associative, so the result is independent of scheduling). A NaN/inf anywhere gives bits
``>= 0x7F800000``, which the host wrappers treat as "non-finite input".
Per row: one program per ``BM`` rows loops over K and writes float32 ``[M]``, and also folds its rows
into the per-tensor bits (the RAC score shift needs the global amax of per-token activations).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERP, rmax, ub


@triton.jit
def _amax_tile_kernel(x_ptr, out_bits_ptr, M, K, stride_m, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :], mask=mask, other=0.0)
    a = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)
    tl.atomic_max(out_bits_ptr, rmax(rmax(a, 1), 0), sem="relaxed")


@triton.jit
def _amax_single_kernel(x_ptr, out_bits_ptr, N, BLOCK: tl.constexpr):
    # one program over a small contiguous tensor (decode): no atomics, so no zero-fill launch
    acc = tl.full((BLOCK,), 0, tl.int32)
    for i0 in range(0, ub(N), BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True))
    tl.store(out_bits_ptr, rmax(acc, 0))


@triton.jit
def _amax_rows_kernel(x_ptr, out_ptr, out_bits_ptr, M, K, stride_m, BM: tl.constexpr, BK: tl.constexpr,
                      GLOBAL: tl.constexpr):
    pid_m = tl.program_id(0)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    acc = tl.full((BM,), 0, tl.int32)
    for k0 in range(0, ub(K), BK):
        cols = k0 + tl.arange(0, BK)
        mask = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :], mask=mask, other=0.0)
        a = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)
        acc = tl.maximum(acc, rmax(a, 1))
    tl.store(out_ptr + rows, acc.to(tl.float32, bitcast=True), mask=rmask)
    if GLOBAL:
        tl.atomic_max(out_bits_ptr, rmax(acc, 0), sem="relaxed")


SMALL = 16384  # elements: one program, one tile (decode activations); no atomic, no zero-fill launch


def needs_zeroed_output(x) -> bool:
    """Whether :func:`launch_amax_tensor` accumulates atomically (output must start at 0)."""
    return not (x.numel() <= SMALL and x.is_contiguous())


def launch_amax_tensor(x, out_bits):
    """``out_bits`` int32 [1] <- max over x [M, K] of bits(|x|); zero it first if ``needs_zeroed_output``."""
    m, k = x.shape
    if not needs_zeroed_output(x):
        block = 1024 if INTERP else SMALL
        _amax_single_kernel[(1,)](x, out_bits, m * k, BLOCK=block, num_warps=4 if INTERP else 8)
        return
    bm, bk = (16, 64) if INTERP else (32, 256)
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _amax_tile_kernel[grid](x, out_bits, m, k, x.stride(0), BM=bm, BK=bk, num_warps=4)


def launch_amax_rows(x, out_rows, out_bits=None):
    """``out_rows`` float32 [M] <- max|x| per row; ``out_bits`` (int32 [1], zeroed; optional) <- global max bits."""
    m, k = x.shape
    if INTERP:
        bm, bk, nw = 16, 64, 4
    else:
        bm, bk, nw = (1, 1024, 4) if m < 4096 else (4, 512, 4)
    _amax_rows_kernel[(triton.cdiv(m, bm),)](x, out_rows, out_bits if out_bits is not None else out_rows, m, k,
                                             x.stride(0), BM=bm, BK=bk, GLOBAL=out_bits is not None, num_warps=nw)
