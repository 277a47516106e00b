"""Master weights -> rollout constants: the one function every path uses (passes, sync, exports).

SPEC §3 rule 1: the members of a fused group (q/k/v, gate/up) share one amax when the spec has a
global scale (NVFP4 weights); rule 2: the amax is recomputed from the current weights (never
stale). Used by the generic linear lowering pass, :func:`qpass.runtime.sync.sync_weights`, the
SGLang trainer-side export and the Megatron export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qpass.formats.spec import QuantSpec
from qpass.quant.checks import check_float_input
from qpass.quant.groups import group_amax


@dataclasses.dataclass(frozen=True)
class SiteWeights:
    """One site's quantized weight.

    Attributes:
        tensor: the quantized tensor (``NVFP4Tensor`` / ``MXFP4Tensor`` / ``FP8Tensor``).
        constants: ``{name: tensor}`` the rollout graph stores (``rollout_lower`` entry's order).
        flushed_blocks: blocks with a non-zero element whose block scale underflowed to 0 (decode
            to zero, SPEC §3 keep-zero rule); 0 for formats without that failure mode.
    """

    tensor: Any
    constants: dict[str, torch.Tensor]
    flushed_blocks: int = 0


def quantize_site_weights(
    spec: QuantSpec,
    weights_of_group: Mapping[str, torch.Tensor],
    *,
    names: Mapping[str, str] | None = None,
    process_group: object | None = None,
    also_in_group: Sequence[torch.Tensor] = (),
) -> dict[str, SiteWeights]:
    """Quantize the weights of one quantization group with the ``reference`` table entry of ``spec``.

    Args:
        spec: a weight spec (``NVFP4_WEIGHT``, ``MXFP4_WEIGHT``, an ``FP8Spec`` ...).
        weights_of_group: ``{site id: weight [N, K]}`` (bf16/fp16/fp32); a fused group's members,
            or a single site. With ``spec.has_global_scale`` they share one amax.
        names: ``{site id: tensor name}`` for error messages (default: the site id).
        process_group: the group amax is all-reduced with MAX over it (sharded weights).
        also_in_group: other members' weights that share the amax but are not quantized here
            (e.g. the other layers of a Megatron fused group).
    Returns:
        ``{site id: SiteWeights}`` in the order of ``weights_of_group``.
    Raises:
        QuantizationError: a member is not encodable (NaN/inf, bad K ...); the message names
            that member, never another one of the group.

    Inside :func:`qpass.quant.reuse.reuse_weight_quantization` each member's amax and quantized
    tensor are computed once per weight version (:func:`cached_reference_quantize`).
    """
    from qpass.tables import entry

    names = dict(names or {})
    lowering = entry("rollout_lower", spec)
    for sid, w in weights_of_group.items():  # validate each member by its own name before the shared amax
        check_float_input(w, op=f"quantize {spec.key}", multiple_of=lowering.k_multiple, name=names.get(sid, sid), site=sid)
    members = [*weights_of_group.values(), *(t.detach() for t in also_in_group)]
    amax = group_amax(members, process_group=process_group) if spec.has_global_scale else None
    out = {}
    for sid, w in weights_of_group.items():
        q = cached_reference_quantize(spec, w.detach(), amax, site=sid, name=names.get(sid, sid))
        out[sid] = SiteWeights(q, lowering.constants(q), _flushed(q))
    return out


def cached_reference_quantize(spec: QuantSpec, w: torch.Tensor, amax: torch.Tensor | None, *, site: str | None = None,
                              name: str | None = None) -> Any:
    """``qpass.tables.backend_quantize(spec, w, amax, site, name)`` (the reference quantizer's bytes, on
    the kernel backend in effect), memoized per ``(w version, amax bits, spec)`` inside :func:`qpass.quant.reuse.reuse_weight_quantization` (outside: a plain call).

    Args:
        spec: a weight spec; w: the weight ``[N, K]`` (bf16/fp16/fp32); amax: float32 0-dim group
            amax or None; site, name: for error messages only (not part of the key).
    Returns:
        the quantized tensor (shared with other callers in the context: read-only).
    """
    from qpass.quant.reuse import amax_bits, memo, reuse_active
    from qpass.tables import backend_quantize

    if not reuse_active():
        return backend_quantize(spec, w, amax, site=site, name=name)
    return memo("reference", (w,), (spec, amax_bits(amax)), lambda: backend_quantize(spec, w, amax, site=site, name=name))


def _flushed(q: Any) -> int:
    count = getattr(q, "flushed_blocks", None)  # formats whose block scale can underflow to 0
    return count() if count is not None else 0
