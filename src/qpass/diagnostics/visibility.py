"""Update visibility: how much of a quantized weight changes after an optimizer step (SPEC §4).

RL weight updates are small (QuRL reports ~1e-7 relative) next to the NVFP4 quantization step, so
a rollout that receives re-quantized weights may see only a fraction of an update, or none. Given
the quantizations of one weight (or one quantization group) before and after a step, this reports
the fraction of element codes, block-scale bytes and decoded values that changed, and whether the
global decode scale changed.

Codes and scale bytes are compared in the canonical form of the parity object (SPEC §3 rule 4,
:mod:`qpass.parity.object`): ``-0`` codes equal ``+0`` and every block that decodes to all zeros is
canonical zero, so a byte flip that cannot change a decoded value is not counted as visible. The
decoded comparison (``value_frac``) is the direct answer to "does the rollout compute anything
different"; codes and scales say where the change came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from qpass.parity.object import parity_object
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_dequantize

__all__ = ["GroupVisibility", "UpdateVisibility", "update_visibility", "update_visibility_groups"]


@dataclasses.dataclass(frozen=True)
class UpdateVisibility:
    """Changed-element counts between two NVFP4 quantizations of the same tensor.

    Attributes:
        name: tensor or group name ("" if not given).
        n_codes: elements (one E2M1 code each; ``prod(shape)``).
        n_codes_changed: elements whose canonical code changed.
        n_scales: block-scale bytes (``prod(shape) / 16``).
        n_scales_changed: canonical scale bytes that changed.
        n_values_changed: elements whose decoded bf16 value (the rollout GEMM operand, SPEC §3
            dequant) changed (float equality: -0 == +0).
        n_global: global decode scales (1 per tensor/group; one per row for per-token).
        n_global_changed: global decode scales whose float32 bits changed.
    """

    name: str
    n_codes: int
    n_codes_changed: int
    n_scales: int
    n_scales_changed: int
    n_values_changed: int
    n_global: int
    n_global_changed: int

    @property
    def code_frac(self) -> float:
        """Fraction of element codes that changed (0 for an empty tensor)."""
        return self.n_codes_changed / self.n_codes if self.n_codes else 0.0

    @property
    def scale_frac(self) -> float:
        """Fraction of block-scale bytes that changed."""
        return self.n_scales_changed / self.n_scales if self.n_scales else 0.0

    @property
    def value_frac(self) -> float:
        """Fraction of elements whose decoded value changed."""
        return self.n_values_changed / self.n_codes if self.n_codes else 0.0

    @property
    def global_changed(self) -> bool:
        """True if any global decode scale changed."""
        return self.n_global_changed > 0

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{name: float}`` for logging (fractions and counts)."""
        return {
            f"{prefix}code_frac": self.code_frac,
            f"{prefix}scale_frac": self.scale_frac,
            f"{prefix}value_frac": self.value_frac,
            f"{prefix}global_changed": float(self.global_changed),
            f"{prefix}n_codes": float(self.n_codes),
            f"{prefix}n_scales": float(self.n_scales),
        }


def _check(q: object, arg: str, name: str) -> NVFP4Tensor:
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"{arg} must be an NVFP4Tensor, got {type(q).__name__}" + (f" for {name!r}" if name else ""))
    return q


def update_visibility(before: NVFP4Tensor, after: NVFP4Tensor, name: str = "") -> UpdateVisibility:
    """Compare two NVFP4 quantizations of one weight (before and after an optimizer step).

    Args:
        before, after: :class:`~qpass.quant.nvfp4.NVFP4Tensor` of the same logical shape (codes
            uint8 ``[..., K/2]``, scales e4m3 ``[..., K/16]``, float32 ``s_dec``).
        name: label carried into the result.
    Returns:
        :class:`UpdateVisibility` with exact integer counts.
    Raises:
        TypeError: an argument is not an NVFP4Tensor.
        ValueError: the two shapes (or global-scale shapes) differ.
    Source: SPEC §4 "update visibility"; canonical bytes per SPEC §3 rule 4.
    """
    _check(before, "before", name)
    _check(after, "after", name)
    if tuple(before.shape) != tuple(after.shape):
        raise ValueError(
            f"update_visibility: shapes differ for {name or 'tensor'}: "
            f"before {tuple(before.shape)}, after {tuple(after.shape)}"
        )
    if tuple(before.s_dec.shape) != tuple(after.s_dec.shape):
        raise ValueError(
            f"update_visibility: global-scale shapes differ for {name or 'tensor'}: "
            f"before {tuple(before.s_dec.shape)}, after {tuple(after.s_dec.shape)}"
        )
    pa, pb = parity_object(before, name), parity_object(after, name)
    va = nvfp4_dequantize(before, torch.bfloat16).cpu()  # the operand the rollout GEMM consumes
    vb = nvfp4_dequantize(after, torch.bfloat16).cpu()
    # float equality, so +0 == -0 on purpose: a sign-of-zero flip is invisible to the GEMM
    return UpdateVisibility(
        name=name,
        n_codes=pa.codes.numel(),
        n_codes_changed=int((pa.codes != pb.codes).sum()),
        n_scales=pa.scale_bytes.numel(),
        n_scales_changed=int((pa.scale_bytes != pb.scale_bytes).sum()),
        n_values_changed=int((va != vb).sum()),
        n_global=pa.s_dec_bits.numel(),
        n_global_changed=int((pa.s_dec_bits != pb.s_dec_bits).sum()),
    )


@dataclasses.dataclass(frozen=True)
class GroupVisibility:
    """Per-group and pooled update visibility.

    Attributes:
        per_group: ``{name: UpdateVisibility}`` in the order of ``before``.
        total: counts summed over all groups (fractions are element-weighted), name ``"total"``.
    """

    per_group: dict[str, UpdateVisibility]
    total: UpdateVisibility


def update_visibility_groups(
    before: Mapping[str, NVFP4Tensor], after: Mapping[str, NVFP4Tensor]
) -> GroupVisibility:
    """:func:`update_visibility` for every named weight / quantization group, plus the pooled total.

    Args:
        before, after: ``{name: NVFP4Tensor}`` with the same keys.
    Returns:
        :class:`GroupVisibility`.
    Raises:
        ValueError: the key sets differ (the message lists the names missing on each side), or a
            shape differs (see :func:`update_visibility`).
        TypeError: a value is not an NVFP4Tensor.
    """
    ka, kb = set(before), set(after)
    if ka != kb:
        raise ValueError(
            f"update_visibility_groups: names differ; only in before: {sorted(ka - kb)}, only in after: {sorted(kb - ka)}"
        )
    per = {k: update_visibility(before[k], after[k], name=k) for k in before}
    fields = ("n_codes", "n_codes_changed", "n_scales", "n_scales_changed", "n_values_changed", "n_global", "n_global_changed")
    total = UpdateVisibility("total", **{f: sum(getattr(v, f) for v in per.values()) for f in fields})
    return GroupVisibility(per_group=per, total=total)
