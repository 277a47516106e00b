"""FP4 E2M1: 1 sign, 2 exponent, 1 mantissa bit. Magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

Code = ``sign << 3 | magnitude_index``. Two codes per byte: element ``2j`` in the low nibble,
``2j+1`` in the high nibble (the order of torchao, ModelOpt, compressed-tensors and the CUDA
``cvt.rn.satfinite.e2m1x2`` instruction).
"""

from __future__ import annotations

import torch

from qpass.formats.spec import TieRule
from qpass.sync_checks import sync_checks_enabled

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, with the side an exact tie goes to under RNE:
# 0.25 -> 0 (even index 0), 0.75 -> 1.0 (index 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP_RNE = (False, True, False, True, False, True, False)

_LUT_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_lut(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16-entry code -> value table (codes 8..15 are the negatives; code 8 is -0.0)."""
    key = (torch.device(device), dtype)
    if key not in _LUT_CACHE:
        vals = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
        _LUT_CACHE[key] = torch.tensor(vals, dtype=dtype, device=device)
    return _LUT_CACHE[key]


def e2m1_encode(y: torch.Tensor, tie_rule: TieRule = TieRule.NEAREST_EVEN) -> torch.Tensor:
    """Round float32 values already clamped to [-6, 6] to E2M1 codes.

    Args:
        y: float32, any shape, ``|y| <= 6``.
        tie_rule: how exact midpoints round (nearest-even is the reference; the others exist to
            emulate DeepGEMM / MSLK-ROCm).
    Returns:
        uint8 codes, same shape, ``sign << 3 | index``. The sign bit is set for strictly negative
        ``y`` (a tiny negative value gives code 0x8, ``-0.0`` gives 0x0).

    The magnitude index is the number of midpoints below ``|y|``; the comparisons are exact, so the
    tie side is decided by ``>`` versus ``>=`` alone.
    """
    a = y.abs()
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for mid, up in zip(E2M1_MIDPOINTS, _TIE_GOES_UP_RNE):
        if tie_rule == TieRule.NEAREST_EVEN:
            hit = (a >= mid) if up else (a > mid)
        elif tie_rule == TieRule.TOWARD_ZERO:
            hit = a > mid
        else:
            hit = a >= mid
        idx += hit.to(torch.uint8)
    return idx | ((y < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 E2M1 codes (one code per element, values 0..15)."""
    return e2m1_lut(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] (K even) into bytes [..., K/2]: low nibble = even k."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.is_floating_point():
        raise ValueError("pack_e2m1 needs integer codes in [0, 15] (one E2M1 code per element)")
    if codes.dtype != torch.uint8 or sync_checks_enabled(codes.device):  # uint8 < 16: checked on the host
        if bool(((codes < 0) | (codes > 0xF)).any()):
            raise ValueError("pack_e2m1 needs integer codes in [0, 15] (one E2M1 code per element)")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] into codes [..., K] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed E2M1 codes must be uint8, got {packed.dtype}")
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
