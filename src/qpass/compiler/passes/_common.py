"""Helpers shared by the passes: target selection with skip reasons, node surgery."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pydantic
import torch

from qpass.graph.qgraph import QGraph
from qpass.graph.sites import LINEAR_TARGETS, Site, groups_of, select_sites
from qpass.compiler.manager import Cleanup, Pass, PassOptions, Rewrites
from qpass.formats.spec import QuantSpec
from qpass.tables import entry


def reject_foreign_options(opts: PassOptions, owners: dict[str, tuple[str, str]]) -> None:
    """Refuse an option set explicitly in a recipe whose ``format`` does not own it.

    Args:
        opts: the pass options (a pydantic model with a ``format`` field).
        owners: ``{option: (owning format, what the other formats do instead)}``, e.g.
            ``{"granularity": ("fp8", "has none")}``.
    Raises:
        ValueError: ``"<option> is an <FORMAT> option; format '<format>' <instead>"``.
    """
    fmt = getattr(opts, "format")
    for name, (owner, instead) in owners.items():
        if fmt != owner and name in opts.model_fields_set:
            raise ValueError(f"{name} is an {owner.upper()} option; format {fmt!r} {instead}")


class FormatOptions(PassOptions):
    """Options of a pass with a ``format`` field, some of whose options belong to one format each.

    ``FOREIGN`` is the :func:`reject_foreign_options` table of the subclass; setting an option the
    chosen format does not own fails validation (``ValueError``, wrapped by pydantic).
    """

    FOREIGN: ClassVar[dict[str, tuple[str, str]]] = {}

    @pydantic.model_validator(mode="after")
    def _options_of_the_format(self) -> "FormatOptions":
        reject_foreign_options(self, self.FOREIGN)
        return self


class QDQPass(Pass):
    """A learner-side QDQ pass (``act_qdq``, ``weight_qdq``): the contract both declare, and the table
    entries of the spec their options name. Subclasses set ``name``, ``Options``, ``sides``, ``ensures``."""

    requires = ("sites_stamped",)
    mutation = "in_place"
    cleanup = Cleanup.TIDY  # the manager lints and recompiles after the rewrite

    def entries(self) -> tuple[QuantSpec, object, int]:
        """``(spec, its learner_qdq table entry, the K multiple its rollout lowering needs)``."""
        spec = self.options.spec()
        return spec, entry("learner_qdq", spec), entry("rollout_lower", spec).k_multiple


def selected(qg: QGraph, opts: PassOptions, *, need_nvfp4: bool = False) -> tuple[list[Site], list[tuple[str, str]]]:
    """Sites matching ``opts.targets``/``opts.exclude``; those NVFP4 cannot encode go to ``skipped``."""
    sites = select_sites(qg.sites.values(), opts.targets, opts.exclude)
    skipped = []
    if need_nvfp4:
        skipped = [(s.id, f"in_features={s.in_features} is not a multiple of 16") for s in sites if not s.nvfp4_ok]
        sites = [s for s in sites if s.nvfp4_ok]
    return sites, skipped


def k_aligned(sites: Sequence[Site], k_multiple: int, out: Rewrites) -> list[Site]:
    """The sites whose ``in_features`` is a multiple of ``k_multiple``; each other one is skipped on ``out``."""
    ok = []
    for s in sites:
        if s.in_features % k_multiple:
            out.skip(s.id, f"in_features={s.in_features} is not a multiple of {k_multiple}")
        else:
            ok.append(s)
    return ok


def with_linear_nodes(qg: QGraph, members: Sequence[Site], out: Rewrites,
                      done: str) -> tuple[list[Site], dict[str, list[torch.fx.Node]]]:
    """``(members that still have an unrewritten aten.linear node, {site id: those nodes})``; each
    member without one is skipped on ``out`` as ``"no unrewritten aten.linear node (already <done>?)"``."""
    nodes = {s.id: aten_linear_nodes(qg, s.id) for s in members}
    for s in members:
        if not nodes[s.id]:
            out.skip(s.id, f"no unrewritten aten.linear node (already {done}?)")
    return [s for s in members if nodes[s.id]], nodes


def grouped(sites: Sequence[Site]) -> dict[str, list[Site]]:
    return groups_of(sites)


def aten_linear_nodes(qg: QGraph, site_id: str) -> list[torch.fx.Node]:
    """The still-unrewritten ``aten.linear`` call nodes of a site whose weight is a graph attribute."""
    out = []
    for n in qg.nodes_of_site(site_id):
        if n.target in LINEAR_TARGETS and isinstance(n.args[1], torch.fx.Node) and n.args[1].op == "get_attr":
            out.append(n)
    return out


def bias_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return b if isinstance(b, torch.fx.Node) else None


def copy_meta(src: torch.fx.Node, dst: torch.fx.Node, **extra: object) -> None:
    """Carry the qpass stamps (site, handle) and the shape metadata from ``src`` to ``dst``."""
    for key in ("qpass_site", "qpass_handle", "qpass_linear_site", "nn_module_stack", "val", "tensor_meta", "stack_trace"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
    dst.meta.update(extra)


def graph_order(qg: QGraph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(qg.gm.graph.nodes)}
