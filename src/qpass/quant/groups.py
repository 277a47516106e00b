"""Quantization groups: tensors that share one global amax, optionally all-reduced across ranks.

SPEC §3 rule 1: fused projections (q/k/v, gate/up, MoE w1/w3) share one ``amax``; under tensor or
expert parallelism the group amax is all-reduced with MAX, so a sharded quantization equals the
unsharded one bit for bit (every 1x16 block lies inside one shard when shard widths are multiples
of 16).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qpass.errors import QuantizationError


def tensor_amax(x: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """``max |x|`` in float32 (exact: abs and max never round).

    Args:
        x: bf16/fp16/fp32 tensor of any shape with at least one element.
        per_row: if True, reduce only the last dim and keep it: shape ``x.shape[:-1] + (1,)``.
    Returns:
        float32, shape ``()`` or ``x.shape[:-1] + (1,)``.
    """
    a = x.detach().abs()
    if per_row:
        return a.amax(dim=-1, keepdim=True).float()
    return a.amax().float()


def member_amax(t: torch.Tensor) -> torch.Tensor:
    """:func:`tensor_amax` of one weight (float32 0-dim), computed once per tensor version inside
    :func:`qpass.quant.reuse.reuse_weight_quantization` (an in-place write to ``t`` invalidates it)."""
    from qpass.quant.reuse import memo

    return memo("amax", (t,), None, lambda: tensor_amax(t))


def group_amax(
    tensors: Sequence[torch.Tensor],
    *,
    process_group: object | None = None,
) -> torch.Tensor:
    """Shared amax of a quantization group: ``max_i max |t_i|``, all-reduced with MAX if asked.

    Args:
        tensors: the group members (e.g. the q, k and v weights of one attention block, or this
            rank's shards of them). Shapes may differ.
        process_group: a ``torch.distributed`` process group over which the group is sharded
            (tensor/expert parallel); ``None`` for an unsharded group.
    Returns:
        float32 0-dim tensor on the device of the first member.
    Raises:
        QuantizationError: empty group.
    """
    if len(tensors) == 0:
        raise QuantizationError("group_amax needs at least one tensor")
    amax = torch.stack([member_amax(t).to(tensors[0].device) for t in tensors]).amax()
    return allreduce_max(amax, process_group)


def allreduce_max(amax: torch.Tensor, process_group: object | None) -> torch.Tensor:
    """All-reduce an amax tensor with MAX over ``process_group`` (no-op when it is None)."""
    if process_group is None:
        return amax
    import torch.distributed as dist

    out = amax.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=process_group)
    return out
