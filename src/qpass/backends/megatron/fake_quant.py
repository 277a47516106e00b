"""NVFP4 weight fake-quant (QUADS learner side, SPEC §2, factored as SPEC §3.1) for megatron-core's
parallel linears.

What runs in every forward of a patched ``ColumnParallelLinear`` / ``RowParallelLinear``::

    amax  = max|W_shard|                      (and the other members of a fused group, if separate)
    amax  = all_reduce(amax, MAX, TP group)   SPEC §3 rule 1: every rank uses the unsharded amax
    B_W   = qpass::nvfp4_operand_ste(W_shard, amax)   e2m1 * s_b of qpass's own quantizer (exact)
    z     = <Megatron's own _forward_impl>(x, B_W, bias=None, ...)
    y     = z * S_dec_W (+ bias)              the per-tensor scale once, on the output

Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``; qpass quantizes each of
those groups with one amax, so the amax over a rank's slice of the fused weight, all-reduced over
TP, is exactly qpass's group amax. Every 1x16 block lies along K inside one rank's slice when
``K / TP`` is a multiple of 16 (row-parallel) — the quantization of each slice with the shared
amax is then byte-identical to the slice of the unsharded quantization, and
:func:`export_nvfp4_weight` all-gathers those bytes into what ``qpass.nvfp4_quantize`` gives for the
full weight.

The hook is ``_forward_impl(input, weight, ...)``, through which both classes route their matmul
(also the frozen-weight path): Megatron's autograd function saves ``B_W`` for the input gradient,
so ``dL/dX = (dL/dY * S_dec_W) B_W`` (the SPEC's ``S_dec_W * (dL/dY B_W)`` up to where the scale
is rounded), and ``nvfp4_operand_ste``'s backward turns Megatron's ``dL/dB_W = S_dec_W * dL/dW_hat``
into the straight-through ``dL/dW = dL/dW_hat = fl(dL/dB_W / S_dec_W)``. Megatron's matmul rounds
``z`` to the activation dtype before the scale (a bf16 model: one more rounding than the graph
learner's ``fl(acc * S_dec_W)``). A pre-forward hook that swaps ``weight.data`` would make backward
use the unquantized weight, and ``torch.nn.utils.parametrize`` drops Megatron's tensor-parallel
attributes (prior-art §3). ``gradient_accumulation_fusion`` is switched off on patched layers (the
fused wgrad kernel writes into ``weight.main_grad`` of the tensor it receives, which would be
``B_W``). :func:`fake_quant_weight` gives the dense ``W_hat`` (what the checks compare).

Requires megatron-core (tested with 0.16.1, TE-free local layers, CPU/gloo and CUDA/NCCL alike).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import types
from collections.abc import Sequence
from typing import Any

import torch

from qpass.errors import QuantizationError
from qpass.quant.groups import allreduce_max, tensor_amax
from qpass.formats.spec import NVFP4_WEIGHT
from qpass.quant.nvfp4 import NVFP4Tensor
from qpass.quant.weights import quantize_site_weights

log = logging.getLogger(__name__)

DEFAULT_EXCLUDE = ("*output_layer", "*embedding*")


@dataclasses.dataclass
class NVFP4WeightQuant:
    """Per-layer fake-quant state (``layer.qpass_nvfp4``).

    Attributes:
        site: name for errors and reports (module path).
        process_group: group over which the weight is sharded (the layer's TP group); the amax
            is all-reduced with MAX over it. None: no reduction (TP = 1).
        sync_amax: False reproduces the *wrong* per-shard global scale (for demonstrations/tests).
        shared: other layers whose weights belong to the same quantization group (only needed
            when a model keeps fused projections as separate modules).
        enabled: switch fake-quant off without unpatching.
    """

    site: str
    process_group: Any = None
    sync_amax: bool = True
    shared: tuple[torch.nn.Module, ...] = ()
    enabled: bool = True


def _parallel_linear_types() -> tuple[type, type]:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def group_amax_of(layer: torch.nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
    """float32 0-dim group amax of ``layer`` (fresh: from the current weights, SPEC §3 rule 2)."""
    st: NVFP4WeightQuant = layer.qpass_nvfp4
    w = layer.weight if weight is None else weight
    amax = tensor_amax(w)
    for other in st.shared:
        amax = torch.maximum(amax, tensor_amax(other.weight).to(amax.device))
    return allreduce_max(amax, st.process_group if st.sync_amax else None)


def fake_quant_weight(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The dense ``W_hat = qpass::nvfp4_qdq(weight, group amax)`` (straight-through gradient): what
    the learner checks compare; the patched forward multiplies :func:`factored_weight` instead."""
    from qpass.quant import qdq  # noqa: F401 - registers torch.ops.qpass.nvfp4_qdq

    st: NVFP4WeightQuant = layer.qpass_nvfp4
    if weight.shape[-1] % 16:
        raise QuantizationError(f"NVFP4 fake-quant of {st.site}: K={weight.shape[-1]} per rank is not a multiple of 16")
    return torch.ops.qpass.nvfp4_qdq(weight, group_amax_of(layer, weight), st.site)


def factored_weight(layer: torch.nn.Module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_W, S_dec_W)`` of the layer's weight shard (SPEC §3.1): ``B_W`` from
    ``qpass::nvfp4_operand_ste`` (STE backward ``dL/dW = dL/dB_W / S_dec_W``), ``S_dec_W`` float32 0-dim.

    Raises:
        QuantizationError: K per rank is not a multiple of 16 (names the site).
    """
    from qpass.quant import qdq  # noqa: F401 - registers torch.ops.qpass.nvfp4_operand_ste
    from qpass.quant.nvfp4 import global_scales

    st: NVFP4WeightQuant = layer.qpass_nvfp4
    if weight.shape[-1] % 16:
        raise QuantizationError(f"NVFP4 fake-quant of {st.site}: K={weight.shape[-1]} per rank is not a multiple of 16")
    amax = group_amax_of(layer, weight)
    return torch.ops.qpass.nvfp4_operand_ste(weight, amax, st.site), global_scales(amax.detach())[1]


def _patched_forward_impl(self: torch.nn.Module, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
    orig = type(self)._forward_impl
    if not self.qpass_nvfp4.enabled:
        return orig(self, input, weight, *args, **kwargs)
    if args:  # bias passed positionally (Megatron 0.16 passes keywords)
        bias, args = args[0], (None, *args[1:])
    else:
        bias = kwargs.get("bias")
        kwargs = {**kwargs, "bias": None}
    b_w, s_dec = factored_weight(self, weight)
    out = orig(self, input, b_w, *args, **kwargs) * s_dec
    return out if bias is None else out + bias


def enable_nvfp4_weight_fake_quant(
    layer: torch.nn.Module, *, site: str | None = None, process_group: Any = "tp", sync_amax: bool = True,
    shared: Sequence[torch.nn.Module] = (),
) -> NVFP4WeightQuant:
    """Patch one Column/RowParallelLinear instance (works on already-built models).

    Args:
        layer: a megatron-core ``ColumnParallelLinear`` or ``RowParallelLinear``.
        site: name for errors (default: the class name).
        process_group: ``"tp"`` (default) = the layer's own ``tp_group`` (or Megatron's TP group);
            a process group; or None.
        sync_amax: all-reduce the amax (False only to demonstrate the mismatch).
        shared: other layers of the same quantization group.
    Returns:
        The layer's :class:`NVFP4WeightQuant` (also ``layer.qpass_nvfp4``).
    Raises:
        TypeError: not a megatron-core parallel linear.
    """
    col, row = _parallel_linear_types()
    if not isinstance(layer, col | row):
        raise TypeError(f"NVFP4 fake-quant patches megatron-core Column/RowParallelLinear, got {type(layer).__name__} ({site})")
    if process_group == "tp":
        process_group = getattr(layer, "tp_group", None)
        if process_group is None:
            from megatron.core import parallel_state as ps

            process_group = ps.get_tensor_model_parallel_group()
    st = NVFP4WeightQuant(site or type(layer).__name__, process_group, sync_amax, tuple(shared))
    layer.qpass_nvfp4 = st
    if getattr(layer, "gradient_accumulation_fusion", False):
        log.warning("%s: gradient_accumulation_fusion disabled (the fused wgrad would accumulate into W_hat.main_grad)", st.site)
        layer.gradient_accumulation_fusion = False
    layer._forward_impl = types.MethodType(_patched_forward_impl, layer)
    return st


def enable_on_model(
    model: torch.nn.Module, *, targets: Sequence[str] = ("*",), exclude: Sequence[str] = DEFAULT_EXCLUDE,
    process_group: Any = "tp", sync_amax: bool = True,
) -> list[str]:
    """Patch every Column/RowParallelLinear of ``model`` whose module path matches ``targets``
    (globs) and not ``exclude`` (default: output layer and embeddings). Returns the patched paths."""
    col, row = _parallel_linear_types()
    done = []
    for name, mod in model.named_modules():
        if isinstance(mod, col | row) and any(fnmatch.fnmatchcase(name, t) for t in targets) and not any(fnmatch.fnmatchcase(name, e) for e in exclude):
            enable_nvfp4_weight_fake_quant(mod, site=name, process_group=process_group, sync_amax=sync_amax)
            done.append(name)
    return done


@torch.no_grad()
def export_nvfp4_weight(layer: torch.nn.Module, *, gather: bool = True) -> NVFP4Tensor:
    """Quantize a patched layer's current weight exactly as its forward does, for the rollout.

    Each rank quantizes its shard with the all-reduced group amax; with ``gather`` the codes and
    scale bytes are all-gathered along the layer's partition dim (``weight.partition_dim``: 0 for
    column-, 1 for row-parallel; packed codes ``K/2`` and scales ``K/16`` along K), giving the
    NVFP4 tensor of the unsharded weight — byte-identical to ``qpass.nvfp4_quantize(W_full)``.

    Raises:
        QuantizationError: the layer is not patched.
    """
    st = getattr(layer, "qpass_nvfp4", None)
    if st is None:
        raise QuantizationError(f"{type(layer).__name__} has no NVFP4 fake-quant (call enable_nvfp4_weight_fake_quant first)")
    w = layer.weight.detach()
    q = quantize_site_weights(
        NVFP4_WEIGHT, {st.site: w}, names={st.site: "weight"}, also_in_group=[o.weight for o in st.shared],
        process_group=st.process_group if st.sync_amax else None,
    )[st.site].tensor
    pg = st.process_group
    if not gather or pg is None:
        return q
    import torch.distributed as dist

    world = dist.get_world_size(pg)
    if world == 1:
        return q
    dim = int(getattr(layer.weight, "partition_dim", 0))
    parts = []
    for t in (q.codes, q.scales.view(torch.uint8)):
        bufs = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(bufs, t.contiguous(), group=pg)
        parts.append(torch.cat(bufs, dim=dim))
    shape = list(q.shape)
    shape[dim] *= world
    return dataclasses.replace(q, codes=parts[0], scales=parts[1].view(torch.float8_e4m3fn), shape=torch.Size(shape))


# ------------------------------------------------------------------------------ fused-layer layout
def split_megatron_qkv(rows: torch.Tensor, *, num_attention_heads: int, num_query_groups: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's fused ``linear_qkv`` rows (per query group: its q heads, one k, one v
    head) into HF ``q_proj``/``k_proj``/``v_proj`` rows.

    Works on any tensor whose dim 0 is the output row: the bf16 weight, the packed codes
    ``[N, K/2]`` or the scales ``[N, K/16]`` — NVFP4 blocks run along K, so permuting rows commutes
    with quantization (shared group amax), and the split quantized bytes are the bytes of the split
    weights.
    """
    qpg = num_attention_heads // num_query_groups
    g = rows.reshape(num_query_groups, (qpg + 2) * head_dim, *rows.shape[1:])
    q = g[:, : qpg * head_dim].reshape(-1, *rows.shape[1:])
    k = g[:, qpg * head_dim:(qpg + 1) * head_dim].reshape(-1, *rows.shape[1:])
    v = g[:, (qpg + 1) * head_dim:].reshape(-1, *rows.shape[1:])
    return q, k, v


def split_megatron_fc1(rows: torch.Tensor, *, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a TP-gathered gated ``linear_fc1`` (rank r holds ``[gate_r; up_r]``) into HF
    ``gate_proj`` / ``up_proj`` rows (same row-permutation argument as :func:`split_megatron_qkv`)."""
    per = rows.reshape(tp_size, 2, rows.shape[0] // (2 * tp_size), *rows.shape[1:])
    return per[:, 0].reshape(-1, *rows.shape[1:]), per[:, 1].reshape(-1, *rows.shape[1:])
