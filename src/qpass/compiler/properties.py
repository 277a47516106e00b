"""Graph properties passes declare (``requires`` / ``ensures``) and the checks that prove them.

A property is a name plus a function ``QGraph -> list[str]`` of violations (empty = holds). The pass
manager checks a pass's ``requires`` before it runs and its ``ensures`` after, so a pass contract is
verified on the graph, never trusted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qpass.graph.opargs import op_args
from qpass.graph.qgraph import QGraph
from qpass.graph.sites import LINEAR_TARGETS

Checker = Callable[[QGraph], list[str]]
PROPERTIES: dict[str, Checker] = {}


def graph_property(name: str) -> Callable[[Checker], Checker]:
    """Register a property checker under ``name``."""

    def deco(fn: Checker) -> Checker:
        PROPERTIES[name] = fn
        return fn

    return deco


def check_property(qg: QGraph, name: str) -> list[str]:
    """Violations of property ``name`` on ``qg`` (KeyError for an unknown property)."""
    if name not in PROPERTIES:
        raise KeyError(f"unknown graph property {name!r}; known: {sorted(PROPERTIES)}")
    return PROPERTIES[name](qg)


def _ops():
    from qpass import ops  # noqa: F401
    from qpass.quant import qdq  # noqa: F401

    return torch.ops.qpass


@graph_property("sites_stamped")
def _sites_stamped(qg: QGraph) -> list[str]:
    bad = []
    for n in qg.gm.graph.nodes:
        if n.op == "call_function" and n.target in LINEAR_TARGETS:
            w = n.args[1]
            if isinstance(w, torch.fx.Node) and w.op == "get_attr" and "qpass_linear_site" not in n.meta:
                bad.append(f"linear node {n.name} (weight {w.target}) has no qpass_linear_site stamp")
    return bad


@graph_property("weight_qdq")
def _weight_qdq(qg: QGraph) -> list[str]:
    q = _ops()
    nodes = qg.call_nodes(q.nvfp4_qdq_linear.default) + qg.call_nodes(q.qdq_linear.default)
    if not nodes:
        return ["no weight-QDQ linear (qpass::nvfp4_qdq_linear / qpass::qdq_linear) node in the graph"]
    bad = []
    for n in nodes:
        a = op_args(n)
        amax = a.get("amax")
        if n.target == q.nvfp4_qdq_linear.default:  # a global scale: the group's fresh amax
            if not (isinstance(amax, torch.fx.Node) and amax.target == q.group_amax.default):
                bad.append(f"{n.name}: amax input is not a qpass::group_amax node")
            elif a["w"] not in op_args(amax)["tensors"]:
                bad.append(f"{n.name}: its weight is not a member of its group_amax")
        if a["site"] != n.meta.get("qpass_linear_site"):
            bad.append(f"{n.name}: site argument {a['site']!r} != stamp {n.meta.get('qpass_linear_site')!r}")
    return bad


@graph_property("act_qdq")
def _act_qdq(qg: QGraph) -> list[str]:
    q = _ops()
    acts = qg.call_nodes(q.nvfp4_act_qdq.default) + [n for n in qg.call_nodes(q.qdq.default) if n.meta.get("qpass_act_site")]
    return [] if acts else ["no activation QDQ (qpass::nvfp4_act_qdq / qpass::qdq) node in the graph"]


def _nvfp4_linear_nodes(qg: QGraph) -> list[torch.fx.Node]:
    return qg.call_nodes(_ops().nvfp4_linear.default)


@graph_property("nvfp4_lowered")
def _nvfp4_lowered(qg: QGraph) -> list[str]:
    nodes = _nvfp4_linear_nodes(qg)
    if not nodes:
        return ["no qpass::nvfp4_linear node in the graph"]
    bad = []
    for n in nodes:
        a = op_args(n)
        codes, scales, s_dec = (qg.gm.get_buffer(str(a[k].target)) for k in ("w_codes", "w_scales", "w_s_dec"))
        k = codes.shape[-1] * 2
        if codes.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn or s_dec.dtype != torch.float32:
            bad.append(f"{n.name} ({a['site']}): constant dtypes {codes.dtype}/{scales.dtype}/{s_dec.dtype}")
        elif scales.shape != (codes.shape[0], k // 16) or s_dec.dim() != 0:
            bad.append(f"{n.name} ({a['site']}): constant shapes {tuple(codes.shape)}/{tuple(scales.shape)}/{tuple(s_dec.shape)}")
        if a["site"] != n.meta.get("qpass_linear_site"):
            bad.append(f"{n.name}: site argument {a['site']!r} != stamp {n.meta.get('qpass_linear_site')!r}")
        static = isinstance(a.get("act_amax"), torch.fx.Node)
        if static != (a["act"] == "nvfp4_static"):
            bad.append(f"{n.name} ({a['site']}): act {a['act']!r} with {'an' if static else 'no'} act_amax constant")
        elif static:
            amax = qg.gm.get_buffer(str(a["act_amax"].target))
            if amax.dtype != torch.float32 or amax.dim() != 0:
                bad.append(f"{n.name} ({a['site']}): act_amax constant is {amax.dtype}{tuple(amax.shape)}, expected float32 0-d")
    return bad


@graph_property("rac")
def _rac(qg: QGraph) -> list[str]:
    from qpass.ops.calls import NVFP4LinearCall

    options = {n: NVFP4LinearCall.decode(op_args(n)) for n in _nvfp4_linear_nodes(qg)}
    nodes = [n for n, (_, rac) in options.items() if rac is not None]
    if not nodes:
        return ["no qpass::nvfp4_linear node with rac_ratio > 0"]
    return [f"{n.name}: RAC on a W4A16 linear (act='none')" for n in nodes if options[n][0] is None]


def _each_op_node(qg: QGraph, op: str, problems: Callable[[torch.fx.Node], list[str]]) -> list[str]:
    """``problems(n)`` of every ``qpass::<op>`` call node, in graph order; one problem when there is none."""
    nodes = qg.call_nodes(getattr(_ops(), op).default)
    if not nodes:
        return [f"no qpass::{op} node in the graph"]
    return [p for n in nodes for p in problems(n)]


@graph_property("mxfp4_lowered")
def _mxfp4_lowered(qg: QGraph) -> list[str]:
    def problems(n: torch.fx.Node) -> list[str]:
        a = op_args(n)
        codes, scales = (qg.gm.get_buffer(str(a[k].target)) for k in ("w_codes", "w_scales"))
        if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape != (codes.shape[0], codes.shape[1] * 2 // 32):
            return [f"{n.name} ({a['site']}): constants {codes.dtype}{tuple(codes.shape)} / {scales.dtype}{tuple(scales.shape)}"]
        return []

    return _each_op_node(qg, "mxfp4_linear", problems)


@graph_property("fp8_lowered")
def _fp8_lowered(qg: QGraph) -> list[str]:
    def problems(n: torch.fx.Node) -> list[str]:
        data = qg.gm.get_buffer(str(op_args(n)["w_data"].target))
        return [f"{n.name}: weight constant dtype {data.dtype}"] if data.dtype != torch.float8_e4m3fn else []

    return _each_op_node(qg, "fp8_linear", problems)
