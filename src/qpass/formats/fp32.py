"""IEEE binary32 helpers: bit views and the constants the quantizers use.

Every quantizer in qpass computes in float32 with one rounding per operation (round to nearest
even). Constants are materialised as float32 tensors so no operation is silently done in float64
or promoted from bf16 (a bf16 tensor times a 0-dim fp32 tensor stays bf16 in eager torch).
"""

from __future__ import annotations

import torch

FLT_MAX = float(torch.finfo(torch.float32).max)  # 3.4028234663852886e38 = 0x7F7FFFFF
FP4_E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
NVFP4_GLOBAL_NUMERATOR = FP8_E4M3_MAX * FP4_E2M1_MAX  # 2688 = 448 * 6


def f32(value: float, device: torch.device | str | None = None) -> torch.Tensor:
    """A 0-dim float32 tensor holding ``fl(value)`` (python float rounded once to binary32)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float32 tensor as int32 (same shape).

    Raises:
        TypeError: ``t`` is not float32.
    """
    if t.dtype != torch.float32:
        raise TypeError(f"bits() needs a float32 tensor, got {t.dtype}")
    return t.contiguous().view(torch.int32)


def from_bits(b: torch.Tensor) -> torch.Tensor:
    """float32 tensor whose bit pattern is the int32 tensor ``b``."""
    if b.dtype != torch.int32:
        raise TypeError(f"from_bits() needs an int32 tensor, got {b.dtype}")
    return b.contiguous().view(torch.float32)


def bits_hex(t: torch.Tensor) -> str:
    """``0x3E2AAAAB``-style hex of a 0-dim (or 1-element) float32 tensor, for reports."""
    return f"0x{int(bits(t.reshape(())).item()) & 0xFFFFFFFF:08X}"
