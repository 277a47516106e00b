"""The parity object (SPEC §3 rule 4) and byte-level comparison of two quantizations.

Parity object per quantization group: (codes with -0 canonicalised 0x8 -> 0x0, E4M3 scale bytes,
bits of ``S_dec``). A block that decodes to all zeros (scale byte 0, or every code +-0) is
canonicalised to zero scale and zero codes, so a zero-scale block equals another block iff every
element of the other decodes to 0 (D5/D6 of ``prior-art/nvfp4_semantics.md``).
"""

from __future__ import annotations

import dataclasses

import torch

from qpass.formats.e2m1 import unpack_e2m1
from qpass.formats.fp32 import bits
from qpass.quant.nvfp4 import BLOCK, NVFP4Tensor


@dataclasses.dataclass(frozen=True)
class ParityObject:
    """Canonical bytes of one quantized tensor.

    Attributes:
        name: site or tensor name.
        codes: uint8 ``[..., K]`` one canonical code per element.
        scale_bytes: uint8 ``[..., K/16]`` canonical E4M3 scale bytes.
        s_dec_bits: int32 bit pattern(s) of the decode global scale.
    """

    name: str
    codes: torch.Tensor
    scale_bytes: torch.Tensor
    s_dec_bits: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ParityDiff:
    """Result of comparing two parity objects (counts are of elements / blocks / scalars).

    ``first_code`` / ``first_scale`` give the first differing index (row, col) or None.
    """

    name: str
    total_codes: int
    total_scales: int
    differing_codes: int
    differing_scales: int
    global_differs: bool
    shape_differs: bool = False
    first_code: tuple[int, ...] | None = None
    first_scale: tuple[int, ...] | None = None

    @property
    def ok(self) -> bool:
        return not (self.shape_differs or self.global_differs or self.differing_codes or self.differing_scales)

    def summary(self) -> str:
        if self.ok:
            return f"{self.name}: identical ({self.total_codes} codes, {self.total_scales} scale bytes, S_dec bits)"
        if self.shape_differs:
            return f"{self.name}: shapes differ"
        parts = []
        if self.differing_codes:
            parts.append(f"{self.differing_codes}/{self.total_codes} codes differ (first at {self.first_code})")
        if self.differing_scales:
            parts.append(f"{self.differing_scales}/{self.total_scales} scale bytes differ (first at {self.first_scale})")
        if self.global_differs:
            parts.append("S_dec bits differ")
        return f"{self.name}: " + "; ".join(parts)


def parity_object_from_parts(
    codes_packed: torch.Tensor, scales: torch.Tensor, s_dec: torch.Tensor, name: str = ""
) -> ParityObject:
    """Canonical parity object from raw parts (packed uint8 codes, e4m3 or uint8 scale bytes, fp32 s_dec).

    Canonicalisation (SPEC §3 rule 4): code 0x8 (-0) -> 0x0; scale byte 0x80 (E4M3 -0) -> 0x00; a
    block that decodes to all zeros (scale 0, or every code +-0 under a non-NaN scale) gets scale 0
    and codes 0. A NaN scale byte (0x7F/0xFF) is kept as is, so it never equals a zero block.
    """
    codes = unpack_e2m1(codes_packed.detach().cpu())
    codes = torch.where(codes == 0x8, torch.zeros_like(codes), codes)
    raw_scales = scales.detach().cpu()
    sb = raw_scales.view(torch.uint8) if raw_scales.dtype != torch.uint8 else raw_scales.clone()
    sb = torch.where(sb == 0x80, torch.zeros_like(sb), sb)  # E4M3 -0.0 is a zero scale
    lead, k = codes.shape[:-1], codes.shape[-1]
    blocks = codes.reshape(*lead, k // BLOCK, BLOCK)
    nan_scale = (sb & 0x7F) == 0x7F  # E4M3 NaN: 0 * NaN is NaN, so such a block never decodes to 0
    zero_block = (sb == 0) | ((blocks == 0).all(dim=-1) & ~nan_scale)
    blocks = torch.where(zero_block.unsqueeze(-1), torch.zeros_like(blocks), blocks)
    sb = torch.where(zero_block, torch.zeros_like(sb), sb)
    return ParityObject(
        name=name,
        codes=blocks.reshape(*lead, k),
        scale_bytes=sb,
        s_dec_bits=bits(s_dec.detach().float().cpu()),
    )


def parity_object(q: NVFP4Tensor, name: str = "") -> ParityObject:
    """Canonical parity object of an :class:`NVFP4Tensor`."""
    return parity_object_from_parts(q.codes, q.scales, q.s_dec, name)


def _first_index(mask: torch.Tensor) -> tuple[int, ...] | None:
    nz = mask.nonzero()
    return tuple(int(i) for i in nz[0]) if nz.shape[0] else None


def compare_parity(a: ParityObject, b: ParityObject, name: str | None = None) -> ParityDiff:
    """Compare two parity objects element by element (exact; no tolerance)."""
    label = name or a.name or b.name
    if a.codes.shape != b.codes.shape or a.scale_bytes.shape != b.scale_bytes.shape:
        return ParityDiff(label, a.codes.numel(), a.scale_bytes.numel(), 0, 0, False, shape_differs=True)
    code_mask = a.codes != b.codes
    scale_mask = a.scale_bytes != b.scale_bytes
    global_differs = a.s_dec_bits.shape != b.s_dec_bits.shape or not bool(torch.equal(a.s_dec_bits, b.s_dec_bits))
    return ParityDiff(
        name=label,
        total_codes=a.codes.numel(),
        total_scales=a.scale_bytes.numel(),
        differing_codes=int(code_mask.sum()),
        differing_scales=int(scale_mask.sum()),
        global_differs=global_differs,
        first_code=_first_index(code_mask),
        first_scale=_first_index(scale_mask),
    )
