"""Name the NVFP4 convention a foreign kernel or checkpoint follows (SPEC §3, last paragraph).

Given foreign bytes (packed codes, E4M3 scale bytes, FP32 global scale) and the high-precision
tensor ``x`` they were made from, :func:`identify` re-quantizes ``x`` with every registered
emulation mode (:data:`qpass.quant.emulation.EMULATIONS`) and reports which modes reproduce the
foreign bytes exactly, after the SPEC §3 rule-4 canonicalisation (``-0`` codes -> ``+0``; a block
that decodes to all zeros equals any other such block) of
:func:`qpass.parity.object.parity_object_from_parts`, with per-mode mismatch counts.

Modes that agree with each other on ``x`` cannot be told apart by it: the result then lists all of
them. Inputs with many exact E4M3/E2M1 midpoints (bf16 data with a short-mantissa amax, integer
multiples of ``2^-6``) separate the modes (``prior-art/nvfp4_semantics.md`` §8 D1/D2/D4).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from qpass.errors import QuantizationError
from qpass.formats.e2m1 import pack_e2m1
from qpass.formats.fp32 import bits
from qpass.quant.emulation import EMULATION_INFO, EMULATIONS
from qpass.quant.layout import from_swizzled_128x4
from qpass.quant.nvfp4 import BLOCK
from qpass.parity.object import ParityObject, compare_parity, parity_object_from_parts

GlobalIs = Literal["decode", "encode", "auto"]


@dataclasses.dataclass(frozen=True)
class ModeMatch:
    """How well one emulation mode reproduces the foreign bytes.

    Attributes:
        mode: emulation mode name.
        differing_codes: canonical element codes that differ (of ``total_codes``).
        differing_scales: canonical scale bytes that differ (of ``total_scales``).
        global_match: which of the mode's global scales has the foreign bits: ``decode``
            (``s_dec``), ``encode`` (``s_enc``) or None (neither / not the one asked for).
        first_code, first_scale: first differing index, or None.
        error: why the mode produced no bytes for ``x`` (it raised), else None.
    """

    mode: str
    differing_codes: int
    differing_scales: int
    global_match: Literal["decode", "encode"] | None
    first_code: tuple[int, ...] | None = None
    first_scale: tuple[int, ...] | None = None
    error: str | None = None

    @property
    def bytes_match(self) -> bool:
        """Codes and scale bytes equal (canonicalised), whatever the global scale."""
        return self.error is None and self.differing_codes == 0 and self.differing_scales == 0

    @property
    def exact(self) -> bool:
        """Codes, scale bytes and global-scale bits all equal."""
        return self.bytes_match and self.global_match is not None


@dataclasses.dataclass(frozen=True)
class IdentifyResult:
    """Outcome of :func:`identify`.

    Attributes:
        matches: modes that reproduce codes, scale bytes and global bits exactly (registration
            order); empty when none does.
        per_mode: :class:`ModeMatch` for every mode tried.
        global_is: the convention the foreign global scale was compared under.
        total_codes, total_scales: element and block counts.
    """

    matches: tuple[str, ...]
    per_mode: dict[str, ModeMatch]
    global_is: GlobalIs
    total_codes: int
    total_scales: int

    @property
    def mode(self) -> str | None:
        """The single matching mode, or None when zero or several modes match."""
        return self.matches[0] if len(self.matches) == 1 else None

    @property
    def byte_matches(self) -> tuple[str, ...]:
        """Modes whose codes and scale bytes match, ignoring the global scale."""
        return tuple(m for m, r in self.per_mode.items() if r.bytes_match)

    def summary(self) -> str:
        """Multi-line human-readable report."""
        head = (
            f"identified: {', '.join(self.matches)}" if self.matches else "identified: none of the emulated conventions"
        )
        lines = [head + f" (global scale compared as {self.global_is})"]
        for r in self.per_mode.values():
            if r.error:
                lines.append(f"  {r.mode}: not applicable ({r.error})")
                continue
            g = f"global = {r.global_match}" if r.global_match else "global bits differ"
            lines.append(
                f"  {r.mode}: {r.differing_codes}/{self.total_codes} codes, "
                f"{r.differing_scales}/{self.total_scales} scale bytes differ; {g}"
            )
        return "\n".join(lines)


def _global_bits(g: torch.Tensor | float) -> torch.Tensor:
    """int32 bits of the foreign global scale (python floats are rounded to float32 once)."""
    t = torch.as_tensor(g, dtype=torch.float32) if not isinstance(g, torch.Tensor) else g.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()  # exact
    if t.dtype != torch.float32:
        raise QuantizationError(f"identify: the foreign global scale must be float32, got {t.dtype}")
    return bits(t.reshape(-1) if t.numel() == 1 else t)


def _canonical_foreign(
    codes: torch.Tensor, scales: torch.Tensor, k: int, lead: torch.Size, scale_layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes [..., K/2] and linear uint8 scale bytes [..., K/16] from what the caller gave."""
    if codes.dtype != torch.uint8:
        raise QuantizationError(f"identify: codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] == k:
        if bool((codes > 0xF).any()):
            raise QuantizationError("identify: unpacked codes (last dim K) must be < 16")
        codes = pack_e2m1(codes)
    if tuple(codes.shape) != tuple(lead) + (k // 2,):
        raise QuantizationError(f"identify: codes shape {tuple(codes.shape)} does not fit x {tuple(lead) + (k,)}")
    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    if raw.dtype != torch.uint8:
        raise QuantizationError(f"identify: scales must be float8_e4m3fn or uint8 bytes, got {scales.dtype}")
    if scale_layout == "swizzled_128x4":
        if len(lead) != 1:
            raise QuantizationError("identify: swizzled scales need a 2-D x")
        raw = from_swizzled_128x4(raw.reshape(-1), int(lead[0]), k // BLOCK)
    elif scale_layout != "linear":
        raise QuantizationError(f"identify: scale_layout must be 'linear' or 'swizzled_128x4', got {scale_layout!r}")
    if tuple(raw.shape) != tuple(lead) + (k // BLOCK,):
        raise QuantizationError(f"identify: scales shape {tuple(raw.shape)} does not fit x {tuple(lead) + (k,)}")
    return codes, raw


def identify(
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    x: torch.Tensor,
    *,
    global_is: GlobalIs = "auto",
    amax: torch.Tensor | float | None = None,
    modes: tuple[str, ...] | None = None,
    scale_layout: Literal["linear", "swizzled_128x4"] = "linear",
) -> IdentifyResult:
    """Which emulated NVFP4 arithmetic produced ``(codes, scales, global_scale)`` from ``x``?

    Args:
        codes: uint8 packed ``[..., K/2]`` (element ``2j`` in the low nibble) or unpacked
            ``[..., K]`` (one code per element).
        scales: E4M3 block scales as ``float8_e4m3fn`` or their ``uint8`` bytes, ``[..., K/16]``
            (``scale_layout='linear'``) or the flat 128x4-swizzled buffer of a 2-D tensor.
        global_scale: the foreign float32 global scale (one element, or ``[..., 1]`` per row).
        x: the bf16/fp16/fp32 tensor ``[..., K]`` the foreign bytes were quantized from.
        global_is: ``decode`` (the foreign value is a decode multiplier, ModelOpt
            ``weight_scale_2``/torchao ``per_tensor_scale``), ``encode`` (an encode scale,
            compressed-tensors ``weight_global_scale``/kernel ``SFScale``) or ``auto`` (either).
        amax: the amax the foreign quantizer used, if known (e.g. a calibrated value); default
            ``max|x|``.
        modes: subset of modes to try; default all registered.
        scale_layout: layout of ``scales``.
    Returns:
        :class:`IdentifyResult` (``matches`` lists every mode reproducing all three parts).
    Raises:
        QuantizationError: shapes/dtypes that do not fit ``x``; bad ``x`` (NaN/inf, K % 16, ...).
        KeyError: an unknown name in ``modes``.
    Source: SPEC §3 (rule 4 and the closing paragraph); ``prior-art/nvfp4_semantics.md`` §8.
    """
    if global_is not in ("decode", "encode", "auto"):
        raise QuantizationError(f"identify: global_is must be 'decode', 'encode' or 'auto', got {global_is!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise QuantizationError(f"identify: x must be a tensor [..., K], got {getattr(x, 'shape', type(x))}")
    lead, k = x.shape[:-1], x.shape[-1]
    if k % BLOCK:
        raise QuantizationError(f"identify: K = {k} is not a multiple of {BLOCK}")
    codes_p, scale_bytes = _canonical_foreign(codes.detach().cpu(), scales.detach().cpu(), k, lead, scale_layout)
    foreign_bits = _global_bits(global_scale)
    zero = torch.zeros((), dtype=torch.float32)
    foreign: ParityObject = parity_object_from_parts(codes_p, scale_bytes, zero, name="foreign")

    names = tuple(EMULATIONS) if modes is None else tuple(modes)
    per_mode: dict[str, ModeMatch] = {}
    for name in names:
        fn = EMULATIONS[name]  # KeyError for unknown names
        try:
            q = fn(x, amax)
        except QuantizationError as exc:
            per_mode[name] = ModeMatch(name, -1, -1, None, error=str(exc))
            continue
        ours = parity_object_from_parts(q.codes, q.scales, zero, name=name)
        d = compare_parity(foreign, ours, name)
        if d.shape_differs:
            raise QuantizationError(f"identify: mode {name!r} produced shapes that do not fit the foreign bytes")
        per_mode[name] = ModeMatch(
            name,
            d.differing_codes,
            d.differing_scales,
            _match_global(foreign_bits, q.s_dec, q.s_enc, global_is),
            d.first_code,
            d.first_scale,
        )
    matches = tuple(n for n, r in per_mode.items() if r.exact)
    return IdentifyResult(
        matches=matches,
        per_mode=per_mode,
        global_is=global_is,
        total_codes=foreign.codes.numel(),
        total_scales=foreign.scale_bytes.numel(),
    )


def _match_global(
    foreign_bits: torch.Tensor, s_dec: torch.Tensor, s_enc: torch.Tensor | None, global_is: GlobalIs
) -> Literal["decode", "encode"] | None:
    def same(t: torch.Tensor | None) -> bool:
        if t is None:
            return False
        b = bits(t.detach().float().cpu())
        b = b.reshape(-1) if b.numel() == 1 else b
        return b.shape == foreign_bits.shape and bool(torch.equal(b, foreign_bits))

    if global_is in ("decode", "auto") and same(s_dec):
        return "decode"
    if global_is in ("encode", "auto") and same(s_enc):
        return "encode"
    return None


def mode_info(name: str) -> str:
    """``name (native global): source`` for a registered mode (for reports)."""
    i = EMULATION_INFO[name]
    return f"{i.name} ({i.native_global}): {i.source}"


__all__ = ["IdentifyResult", "ModeMatch", "identify", "mode_info"]
