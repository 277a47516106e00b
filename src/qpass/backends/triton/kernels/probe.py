"""Elementwise probes of the numeric helpers in ``common.py`` (for exhaustive bit-level tests).

``OP``: 0 ``e4m3_round_mag``, 1 ``e2m1`` code of ``clamp(x, -6, 6)`` (as float), 2 ``bf16_rne_f32``,
3 ``e4m3_value(e4m3_byte(e4m3_round_mag(|x|)))`` (byte round trip), 4 ``e2m1_value`` of the integer
code ``int(x)``, 5 ``frexp_exp``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    bf16_rne_f32,
    e2m1_index,
    e2m1_value,
    e4m3_byte,
    e4m3_round_mag,
    e4m3_value,
    frexp_exp,
)


@triton.jit
def _probe_kernel(x_ptr, out_ptr, N, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if OP == 0:
        y = e4m3_round_mag(x)
    elif OP == 1:
        c = tl.minimum(tl.maximum(x, -6.0), 6.0)
        y = (e2m1_index(tl.abs(c)) | ((c < 0.0).to(tl.int32) << 3)).to(tl.float32)
    elif OP == 2:
        y = bf16_rne_f32(x)
    elif OP == 3:
        y = e4m3_value(e4m3_byte(e4m3_round_mag(tl.abs(x))))
    elif OP == 4:
        y = e2m1_value(x.to(tl.int32))
    else:
        y = frexp_exp(x).to(tl.float32)
    tl.store(out_ptr + offs, y, mask=mask)


def probe(x, op: int):
    """Apply helper ``op`` elementwise to float32 ``x`` (1-D, contiguous); returns float32."""
    import torch

    out = torch.empty_like(x)
    block = 1024
    _probe_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), OP=op, BLOCK=block, enable_fp_fusion=False)
    return out
