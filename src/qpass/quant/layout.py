"""Block-scale layouts: linear ``[R, C]`` <-> the 128x4 swizzle that cuBLASLt/CUTLASS NVFP4 GEMMs read.

Swizzle: pad rows to a multiple of 128 and scale columns to a multiple of 4 with zero bytes; tiles
of 128 rows x 4 columns are stored tile-row-major; inside a 512-byte tile the byte for (row m,
col k) sits at ``(m % 32) * 16 + ((m // 32) % 4) * 4 + (k % 4)``. Same layout as torchao
``to_blocked`` and vLLM ``swizzle_blockscale`` (``prior-art/nvfp4_semantics.md`` §6).
"""

from __future__ import annotations

import torch


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def to_swizzled_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales ``[R, C]`` (any 1-byte dtype) -> flat swizzled buffer of ``ceil(R/128)*128 * ceil(C/4)*4`` bytes."""
    if scales.dim() != 2:
        raise ValueError(f"scales must be 2-D [rows, k/16], got shape {tuple(scales.shape)}")
    raw = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    r, c = raw.shape
    rt, ct = _ceil(r, 128), _ceil(c, 4)
    padded = torch.zeros(rt * 128, ct * 4, dtype=torch.uint8, device=raw.device)
    padded[:r, :c] = raw
    tiles = padded.reshape(rt, 4, 32, ct, 4)  # row = rt*128 + a*32 + b, col = ct*4 + c
    out = tiles.permute(0, 3, 2, 1, 4).reshape(-1)  # (rt, ct, b, a, c)
    return out.view(scales.dtype) if scales.dtype != torch.uint8 else out


def from_swizzled_128x4(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_swizzled_128x4`: flat buffer -> linear ``[rows, cols]``."""
    raw = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
    rt, ct = _ceil(rows, 128), _ceil(cols, 4)
    if raw.numel() != rt * ct * 512:
        raise ValueError(f"swizzled buffer has {raw.numel()} bytes, expected {rt * ct * 512} for [{rows}, {cols}]")
    tiles = raw.reshape(rt, ct, 32, 4, 4).permute(0, 3, 2, 1, 4)  # back to (rt, a, b, ct, c)
    out = tiles.reshape(rt * 128, ct * 4)[:rows, :cols].contiguous()
    return out.view(buf.dtype) if buf.dtype != torch.uint8 else out
