"""QGraph: a captured graph plus what qpass knows about it (sites, pass history, side).

Every node is stamped before any pass with ``meta['qpass_site']`` (innermost module path) and
``meta['qpass_handle']`` (its index in the captured graph); linear nodes also get
``meta['qpass_linear_site']``. Passes copy these stamps onto the nodes they create, so learner and
rollout nodes pair up by site after any rewrite.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import torch

from qpass.graph.capture import CapturedGraph, GraphKind, clone_graph_module, site_of
from qpass.graph.records import SiteQuant
from qpass.graph.sites import LINEAR_TARGETS, Site, discover_sites, linear_site_of

Side = Literal["base", "learner", "rollout"]

QPASS_LINEAR_OPS: tuple[Any, ...] = ()  # filled lazily (avoid importing qpass.ops at module import)


def quantized_linear_targets() -> tuple[Any, ...]:
    """The rollout linear custom ops: the ``op`` of every ``rollout_lower`` table entry."""
    from qpass.tables import TABLES, load_core

    load_core()
    return tuple(dict.fromkeys(lo.op_overload() for lo in TABLES["rollout_lower"].values()))


def learner_linear_targets() -> tuple[Any, ...]:
    """The learner's weight-QDQ linear ops: the ``linear`` op of every ``learner_qdq`` table entry
    (``qpass::nvfp4_qdq_linear``, ``qpass::qdq_linear``); their input is argument 0, like ``aten.linear``."""
    from qpass.tables import TABLES, load_core

    load_core()
    return tuple(dict.fromkeys(lq.overload("linear") for lq in TABLES["learner_qdq"].values() if "linear" in lq.ops))


def stamp(gm: torch.fx.GraphModule) -> None:
    """Stamp site ids and handles on every node of a freshly captured graph (idempotent)."""
    for i, node in enumerate(gm.graph.nodes):
        node.meta.setdefault("qpass_handle", i)
        stack = node.meta.get("nn_module_stack")
        if stack and "qpass_site" not in node.meta:
            node.meta["qpass_site"] = site_of(list(stack.values())[-1][0])
        if node.op == "call_function" and node.target in LINEAR_TARGETS and "qpass_linear_site" not in node.meta:
            sid = linear_site_of(node)
            if sid is not None:
                node.meta["qpass_linear_site"] = sid


@dataclasses.dataclass
class QGraph:
    """A graph qpass rewrites.

    Attributes:
        gm: the ``torch.fx.GraphModule`` (unlifted ``ExportedProgram.module()``); passes edit it
            in place and backends run it.
        kind: ``scoring`` (full sequence, learner) or ``step`` (static-KV prefill/decode, rollout).
        side: ``base`` (as captured), ``learner`` or ``rollout``.
        sites: linear sites discovered at capture, by id.
        history: one :class:`qpass.compiler.manager.PassResult` per pass run, in order.
        properties: graph properties established by passes (checked by the pass manager).
        captured: the capture record (``ExportedProgram``, export time, step-graph sizes).
        quant: per quantized site, its :class:`qpass.graph.records.SiteQuant` (spec objects, group,
            members, constants, RAC, source weight path); read by weight sync, the parity checker
            and the exports.
    """

    gm: torch.fx.GraphModule
    kind: GraphKind
    side: Side
    sites: dict[str, Site]
    captured: CapturedGraph
    history: list[Any] = dataclasses.field(default_factory=list)
    properties: set[str] = dataclasses.field(default_factory=set)
    quant: dict[str, SiteQuant] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_capture(cls, cap: CapturedGraph) -> "QGraph":
        stamp(cap.gm)
        return cls(gm=cap.gm, kind=cap.kind, side="base", sites=discover_sites(cap.gm), captured=cap, properties={"sites_stamped"})

    def clone(self, side: Side, *, share_params: bool = False) -> "QGraph":
        """Independent copy for one side (own parameters unless ``share_params``; own buffers always)."""
        gm = clone_graph_module(self.gm, share_params=share_params)
        return QGraph(gm=gm, kind=self.kind, side=side, sites=dict(self.sites), captured=self.captured,
                      history=list(self.history), properties=set(self.properties),
                      quant=dict(self.quant))

    # ------------------------------------------------------------------ queries
    def nodes_of_site(self, site_id: str) -> list[torch.fx.Node]:
        """Every call node whose ``qpass_linear_site`` is ``site_id`` (aten or qpass linear)."""
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and n.meta.get("qpass_linear_site") == site_id]

    def linear_nodes(self, targets: tuple[Any, ...] = LINEAR_TARGETS) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and n.target in targets]

    def call_nodes(self, target: Any) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and n.target == target]

    def attr(self, path: str) -> torch.Tensor:
        """Parameter or buffer at a dotted attribute path of the graph module."""
        mod: Any = self.gm
        for part in path.split("."):
            mod = getattr(mod, part)
        return mod

    def has_attr(self, path: str) -> bool:
        try:
            self.attr(path)
            return True
        except AttributeError:
            return False

    # ------------------------------------------------------------------ edits
    def add_constant(self, name: str, value: torch.Tensor, *, before: torch.fx.Node) -> torch.fx.Node:
        """Register ``value`` as a buffer ``name`` on the root module and return a get_attr node for it.

        ``name`` is sanitised to a valid attribute; an existing buffer of that name is replaced.
        """
        attr = re.sub(r"[^0-9a-zA-Z_]", "_", name)
        self.gm.register_buffer(attr, value, persistent=True)
        with self.gm.graph.inserting_before(before):
            node = self.gm.graph.get_attr(attr)
        node.meta["qpass_site"] = before.meta.get("qpass_site", "")
        node.meta["val"] = value
        return node

    def prune(self) -> list[str]:
        """Dead-code-eliminate, drop attributes no node reads any more, lint and recompile.

        Returns the dotted paths of parameters removed (their values now live only as quantized
        constants; weight sync re-derives those from the learner).
        """
        g = self.gm.graph
        g.eliminate_dead_code()
        used = {str(n.target) for n in g.nodes if n.op == "get_attr"}
        removed = []
        for path, _ in list(self.gm.named_parameters(remove_duplicate=False)):
            if path not in used and self.kind == "step" and self.side == "rollout":
                parent, _, leaf = path.rpartition(".")
                mod = self.gm.get_submodule(parent) if parent else self.gm
                if leaf in mod._parameters:
                    del mod._parameters[leaf]
                    removed.append(path)
        g.lint()
        self.gm.recompile()
        return removed
