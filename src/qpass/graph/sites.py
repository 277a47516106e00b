"""Quantization sites: linear projections found in a captured graph, their fused groups and selectors.

A *site* is one linear projection, identified by its module path in the Hugging Face model
(``model.layers.3.mlp.down_proj``). Sites that a fused kernel computes together share one global
amax (SPEC §3 rule 1): q/k/v of one attention block, gate/up of one MLP, MoE w1/w3 of one expert.

Selectors (recipe ``targets`` / ``exclude``) are ordered lists of patterns: a glob on the site id
(``*.mlp.gate_proj``), or ``re:<regex>`` (full match). ``lm_head`` and embeddings are excluded by
default, and so are MoE routers (``*.mlp.gate``). MoE experts are sites
``model.layers.N.mlp.experts.E.{gate,up,down}_proj`` once :func:`qpass.moe.prepare_moe` has split
the fused experts modules (gate/up of one expert fuse into ``...experts.E.gate_up``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Sequence

import torch

from qpass.graph.capture import site_of

LINEAR_TARGETS = (torch.ops.aten.linear.default,)

# Fused groups: (suffixes that fuse, group suffix). The first matching rule wins.
FUSED_GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv"),
    (("gate_proj", "up_proj"), "gate_up"),
    (("w1", "w3"), "w13"),
)
# MoE routers (``mlp.gate`` in Qwen3-MoE, OLMoE, Mixtral; Qwen2-MoE's ``shared_expert_gate``) stay BF16:
# their top-k choice is discrete, and SGLang/vLLM leave them unquantized too.
DEFAULT_EXCLUDE = ("*lm_head", "*embed_tokens", "*embed_out", "*.mlp.gate", "*.shared_expert_gate")


@dataclasses.dataclass(frozen=True)
class Site:
    """One linear projection.

    Attributes:
        id: module path in the HF model, e.g. ``model.layers.0.self_attn.q_proj``.
        weight: graph attribute path of the weight parameter (``model.<id>.weight`` in the wrapper).
        bias: graph attribute path of the bias, or None.
        out_features, in_features: weight shape ``[N, K]``.
        group: fused-group id (``model.layers.0.self_attn.qkv``) or the site id for a singleton.
        role: last path component (``q_proj``...).
        nvfp4_ok: ``in_features % 16 == 0`` (NVFP4 needs whole 1x16 blocks along K).
    """

    id: str
    weight: str
    bias: str | None
    out_features: int
    in_features: int
    group: str
    role: str

    @property
    def nvfp4_ok(self) -> bool:
        return self.in_features % 16 == 0


def _group_of(site_id: str) -> str:
    parent, _, role = site_id.rpartition(".")
    for members, suffix in FUSED_GROUPS:
        if role in members:
            return f"{parent}.{suffix}" if parent else suffix
    return site_id


def linear_site_of(node: torch.fx.Node) -> str | None:
    """Site id of an ``aten.linear`` node from its ``nn_module_stack`` (None if unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    return site_of(path)


def discover_sites(gm: torch.fx.GraphModule) -> dict[str, Site]:
    """All linear projections of a freshly captured graph, keyed by site id (graph order).

    A linear whose weight is not a graph attribute (computed weights) is not a site; a module
    called twice yields one site (both call nodes carry its id).
    """
    sites: dict[str, Site] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        w = node.args[1]
        if not isinstance(w, torch.fx.Node) or w.op != "get_attr":
            continue
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        bias = b.target if isinstance(b, torch.fx.Node) and b.op == "get_attr" else None
        site_id = linear_site_of(node) or site_of(str(w.target)).removesuffix(".weight")
        if site_id in sites:
            continue
        weight = gm.get_parameter(str(w.target)) if _is_param(gm, str(w.target)) else getattr(gm, str(w.target))
        n, k = weight.shape
        sites[site_id] = Site(
            id=site_id, weight=str(w.target), bias=bias, out_features=int(n), in_features=int(k),
            group=_group_of(site_id), role=site_id.rpartition(".")[2],
        )
    return sites


def _is_param(gm: torch.fx.GraphModule, path: str) -> bool:
    try:
        gm.get_parameter(path)
        return True
    except AttributeError:
        return False


def _matches(site_id: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], site_id) is not None
    return fnmatch.fnmatchcase(site_id, pattern)


def select_sites(
    sites: Iterable[Site], targets: Sequence[str], exclude: Sequence[str] = DEFAULT_EXCLUDE
) -> list[Site]:
    """Sites matching any of ``targets`` and none of ``exclude`` (in graph order)."""
    return [s for s in sites if any(_matches(s.id, t) for t in targets) and not any(_matches(s.id, e) for e in exclude)]


def groups_of(sites: Iterable[Site]) -> dict[str, list[Site]]:
    """Selected sites grouped by fused group (a group holds only the selected members)."""
    out: dict[str, list[Site]] = {}
    for s in sites:
        out.setdefault(s.group, []).append(s)
    return out
