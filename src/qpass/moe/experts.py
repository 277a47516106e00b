"""Per-expert linear sites for transformers MoE models.

transformers 5.x stores the experts of one MoE block as 3-D parameters (``gate_up_proj``
``[E, 2I, H]``, rows ``[0, I)`` gate and ``[I, 2I)`` up; ``down_proj`` ``[E, H, I]``) and runs them
through a configurable ``experts_implementation`` (an eager per-expert loop, ``batched_mm``,
``grouped_mm``). None of these is an ``aten.linear`` per expert, so qpass would see no expert
site. :func:`prepare_moe` replaces each such module by :class:`SiteExperts`: children ``0 .. E-1``,
each an :class:`ExpertMLP` with ``gate_proj`` / ``up_proj`` / ``down_proj`` ``nn.Linear`` s holding
exact copies of the expert's rows. The graph then carries, per expert, three ``aten.linear`` calls
on the tokens routed to that expert, with module paths
``model.layers.N.mlp.experts.E.{gate,up,down}_proj`` — the parameter names of Qwen3-MoE and OLMoE
checkpoints (``save_pretrained`` writes exactly these), independent of the implementation chosen.
gate/up of one expert form the fused group ``...experts.E.gate_up`` (SPEC §3 rule 1: MoE w1/w3
share one amax).

Semantics equal the transformers eager loop: for expert ``e`` in increasing order, the tokens with
``e`` among their top-k (``torch.where(top_k_index == e)``, token-major), ``y = down(act(gate(x)) *
up(x)) * w``, accumulated with ``index_add_`` into a zero tensor in the hidden dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from qpass.errors import CaptureError

log = logging.getLogger(__name__)


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``, ``x [T, H] -> [T, H]``."""

    def __init__(self, hidden: int, inter: int, act_fn: nn.Module, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SiteExperts(nn.Module):
    """The experts of one MoE block as per-expert linears (children named ``0 .. E-1``).

    ``forward(hidden [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]`` (same
    signature as transformers' experts modules).
    """

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__()
        for i, e in enumerate(experts):
            self.add_module(str(i), e)
        self.num_experts = len(experts)

    def __iter__(self) -> Iterator[ExpertMLP]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> ExpertMLP:
        return self._modules[str(i)]  # type: ignore[return-value]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, mlp in enumerate(self):
            tok, slot = torch.where(top_k_index == e)
            y = mlp(hidden[tok]) * top_k_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def _is_fused_experts(mod: nn.Module) -> bool:
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3
            and not isinstance(mod, SiteExperts))


def unfuse(mod: nn.Module, name: str) -> SiteExperts:
    """:class:`SiteExperts` holding exact copies of a fused experts module's weights.

    Raises:
        CaptureError: a layout qpass does not know (transposed storage, biases, no ``act_fn``),
            naming the module.
    """
    gu, dn = mod.gate_up_proj, mod.down_proj
    e, two_i, h = gu.shape
    if getattr(mod, "is_transposed", False) or getattr(mod, "has_bias", False) or two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        raise CaptureError(f"{name}: experts layout gate_up_proj {tuple(gu.shape)} / down_proj {tuple(dn.shape)} is not "
                           "[E, 2I, H] / [E, H, I] without bias; qpass cannot split it into per-expert sites")
    if not hasattr(mod, "act_fn"):
        raise CaptureError(f"{name}: experts module {type(mod).__name__} has no act_fn")
    inter = two_i // 2
    experts = []
    with torch.no_grad():
        for i in range(e):
            x = ExpertMLP(h, inter, mod.act_fn, dtype=gu.dtype, device=gu.device)
            x.gate_proj.weight.copy_(gu[i, :inter])
            x.up_proj.weight.copy_(gu[i, inter:])
            x.down_proj.weight.copy_(dn[i])
            x.requires_grad_(gu.requires_grad)
            experts.append(x)
    return SiteExperts(experts)


def prepare_moe(model: nn.Module) -> int:
    """Make ``model``'s MoE blocks capturable with per-expert sites (in place, idempotent).

    Replaces every fused experts module by :class:`SiteExperts` and patches every MoE router with
    the routing record/replay op (:func:`qpass.moe.routing.patch_router`).

    Returns:
        the number of experts modules replaced (0 for a dense model or an already prepared one).
    Raises:
        CaptureError: see :func:`unfuse`.
    """
    from qpass.moe.routing import patch_router

    replaced = 0
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if _is_fused_experts(child):
                setattr(mod, child_name, unfuse(child, full))
                replaced += 1
    layer = 0
    for name, mod in model.named_modules():
        if isinstance(getattr(mod, "experts", None), SiteExperts) and getattr(mod, "gate", None) is not None:
            patch_router(mod.gate, _layer_name(name, layer))
            layer += 1
    if replaced:
        log.info("MoE: split %d experts modules into per-expert linear sites", replaced)
    return replaced


def _layer_name(block_path: str, ordinal: int) -> str:
    """``model.layers.3.mlp`` -> ``layers.3`` (the routing tape's key); else the block ordinal."""
    parts = block_path.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts):
            return f"layers.{parts[i + 1]}"
    return f"moe.{ordinal}"
