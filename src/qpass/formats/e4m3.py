"""FP8 E4M3 (``float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits, max 448, no inf.

``e4m3_round`` is the reference rounding written with integer bit operations (round to nearest
even, subnormals kept, saturating), so that the torch reference, the Triton kernel and any other
port compute the same thing without relying on a library cast. ``torch``'s own
``.to(torch.float8_e4m3fn)`` is used only to store already-representable values; the tests check
that it agrees with ``e4m3_round`` on every E4M3 midpoint.
"""

from __future__ import annotations

import torch

from qpass.formats.fp32 import FP8_E4M3_MAX, bits, from_bits

E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9
_TWO_23 = 8388608.0  # 2^23: adding it to a value in [0, 2^22) rounds that value to an integer (RNE)


def e4m3_round_magnitude(a: torch.Tensor) -> torch.Tensor:
    """Round non-negative float32 values onto the E4M3 grid, nearest-even, saturating at 448.

    Args:
        a: float32, any shape, finite, ``a >= 0``.
    Returns:
        float32, same shape: the E4M3 value nearest to ``a`` (ties to even mantissa), ``<= 448``.

    Normal range (``a >= 2^-6``): keep 3 of the 23 mantissa bits with round-half-even on the bit
    pattern (``b + 0x7FFFF + bit20``, then clear the low 20 bits); a carry into the exponent is the
    correct result. Subnormal range: ``a * 2^9`` is exact, ``fl(a*2^9 + 2^23) - 2^23`` rounds it to
    an integer with one RNE rounding, and ``* 2^-9`` is exact.
    """
    a = torch.clamp(a, max=FP8_E4M3_MAX)
    b = bits(a)
    normal = from_bits((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000)
    scaled = a * 512.0
    subnormal = ((scaled + _TWO_23) - _TWO_23) * E4M3_SUBNORMAL_STEP
    return torch.where(a >= E4M3_MIN_NORMAL, normal, subnormal)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Signed E4M3 RNE satfinite rounding of float32 ``x`` (finite); returns float32 values."""
    x = x.float()
    mag = e4m3_round_magnitude(x.abs())
    return torch.where(x < 0, -mag, mag)


def e4m3_rne_satfinite(x: torch.Tensor) -> torch.Tensor:
    """float32 -> ``torch.float8_e4m3fn`` storage (RNE, subnormals kept, |x| > 448 saturates to 448).

    Args:
        x: float32 (other float dtypes are upcast exactly), finite.
    Returns:
        torch.float8_e4m3fn tensor, same shape.
    """
    return e4m3_round(x).to(torch.float8_e4m3fn)


def e4m3_to_float(t: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of a ``float8_e4m3fn`` tensor."""
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected torch.float8_e4m3fn, got {t.dtype}")
    return t.to(torch.float32)


def e4m3_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes (uint8, same shape) of a ``float8_e4m3fn`` tensor."""
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected torch.float8_e4m3fn, got {t.dtype}")
    return t.view(torch.uint8)
