"""E8M0 (OCP MX scale): an unsigned power-of-two exponent byte, value ``2^(byte - 127)``; 0xFF = NaN."""

from __future__ import annotations

import torch

E8M0_BIAS = 127


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """float32 value ``2^(b-127)`` of uint8 E8M0 bytes (0xFF decodes to NaN)."""
    if byte.dtype != torch.uint8:
        raise TypeError(f"E8M0 scale bytes must be uint8, got {byte.dtype}")
    e = byte.to(torch.int32) - E8M0_BIAS
    val = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    return torch.where(byte == 0xFF, torch.full_like(val, float("nan")), val)
