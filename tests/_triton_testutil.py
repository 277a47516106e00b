"""Shared helpers of the Triton backend tests (CPU: kernels run under the Triton interpreter).

The kernels are loaded in interpreter mode for CPU tensors by ``qpass.backends.triton._loader``
whatever ``TRITON_INTERPRET`` said when ``triton`` was imported, so these tests need no environment
set-up. Every test draws its own seeded random inputs (``fresh_seed``); the seed is part of every
failure message.
"""

from __future__ import annotations

import os
import zlib

import torch


def fresh_seed() -> int:
    """Seed torch from the running test's node id and return the seed (print it in assertion messages).

    Deterministic: the same test draws the same inputs on every run and machine (each test its own
    stream). ``QPASS_TEST_SEED=N`` mixes N in, to explore other inputs on purpose.
    """
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    seed = zlib.crc32(f"{test}|{os.environ.get('QPASS_TEST_SEED', '0')}".encode())
    torch.manual_seed(seed)
    return seed


def activations(m: int, k: int, dtype: torch.dtype = torch.bfloat16, *, outliers: int = 3) -> torch.Tensor:
    """``[m, k]`` activations with log-normal channel scales, ``outliers`` channels x20..x60, a zero
    block and a block whose E4M3 scale lands in the subnormal range (tiny next to the outliers)."""
    scale = torch.exp(torch.randn(k) * 0.7)
    x = torch.randn(m, k) * scale
    ch = torch.randperm(k)[:outliers]
    x[:, ch] *= torch.empty(outliers).uniform_(20, 60)
    if k >= 32:
        x[0, :16] = 0.0
        x[m // 2, 16:32] *= 1e-4
    return x.to(dtype)


def u8(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of an e4m3 / uint8 tensor."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def same_nvfp4(a, b) -> dict[str, bool]:
    """Field-by-field bit equality of two NVFP4Tensors (codes, scale bytes, s_dec, s_enc)."""
    out = {
        "codes": torch.equal(a.codes, b.codes),
        "scales": torch.equal(u8(a.scales), u8(b.scales)),
        "s_dec": torch.equal(a.s_dec, b.s_dec),
        "shape": tuple(a.shape) == tuple(b.shape),
    }
    if a.s_enc is not None and b.s_enc is not None:
        out["s_enc"] = torch.equal(a.s_enc, b.s_enc)
    return out


def rel_fro(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||y - ref|| / ||ref||`` in float64."""
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm())


def factored_exact(x, w, bias=None, act=None, rac=None, static=None) -> torch.Tensor:
    """fp64 value of the factored NVFP4 product (SPEC §3.1) of ``x`` and the quantized ``w``, rows
    flattened (``qpass.quant.linear.nvfp4_linear_exact``): what the kernels are compared against."""
    from qpass.ops.calls import NVFP4LinearCall
    from qpass.quant.linear import nvfp4_linear_exact

    call = NVFP4LinearCall(x=x, weight=w, bias=bias, act=act, rac=rac, rac_channels=static, site="test",
                           out_dtype=torch.float32)
    return nvfp4_linear_exact(call)[0]
