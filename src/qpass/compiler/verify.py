"""Graph verifier as data: a list of rules; the first call node no rule accepts is reported.

Run by the pass manager after every pass in debug mode (and by ``qpass check``). Rules say which
operators may appear on each side: the learner may carry learner QDQ ops, the rollout only rollout
ops (a learner QDQ node in a rollout graph means a pass ran on the wrong side).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch

from qpass.errors import VerificationError
from qpass.graph.opargs import op_args
from qpass.graph.qgraph import QGraph, quantized_linear_targets


@dataclasses.dataclass(frozen=True)
class Rule:
    """``accepts(node, qgraph) -> bool``; ``name`` appears in error messages."""

    name: str
    accepts: Callable[[torch.fx.Node, QGraph], bool]


def _namespace(node: torch.fx.Node) -> str | None:
    t = node.target
    return getattr(t, "namespace", None) if isinstance(t, torch._ops.OpOverload) else None


def _qpass_name(node: torch.fx.Node) -> str | None:
    return node.target.name() if _namespace(node) == "qpass" else None


LEARNER_QPASS_OPS = {"qpass::group_amax", "qpass::nvfp4_qdq", "qpass::nvfp4_qdq_linear", "qpass::nvfp4_operand_ste",
                     "qpass::nvfp4_act_qdq", "qpass::qdq", "qpass::qdq_linear"}
ROLLOUT_QPASS_OPS = {"qpass::nvfp4_linear", "qpass::fp8_linear", "qpass::mxfp4_linear", "qpass::nvfp4_act_qdq"}
# the spec tables' ops must all be in these lists (tests/test_tables.py checks it)
# ops that belong to the model itself, on every side (MoE routing record/replay, qpass.moe.routing)
MODEL_QPASS_OPS = {"qpass::moe_route"}
KNOWN_QPASS_OPS = LEARNER_QPASS_OPS | ROLLOUT_QPASS_OPS | MODEL_QPASS_OPS


def _site_arg_matches(node: torch.fx.Node) -> bool:
    """A rollout linear's ``site`` argument equals its ``qpass_linear_site`` stamp."""
    if _qpass_name(node) in ROLLOUT_QPASS_OPS and node.meta.get("qpass_linear_site") is not None:
        args = op_args(node)
        if "site" in args and node.target in quantized_linear_targets():
            return args["site"] == node.meta.get("qpass_linear_site")
    return True


RULES: list[Rule] = [
    Rule("aten/prims operator", lambda n, qg: _namespace(n) in ("aten", "prims", "_c10d_functional")),
    Rule("tuple indexing", lambda n, qg: n.target is operator.getitem),
    Rule("opaque fallback module (qpass.graph.fallback)", lambda n, qg: _namespace(n) == "qpass_opaque"),
    Rule("higher-order op (e.g. a no_grad region torch.export wraps)",
         lambda n, qg: isinstance(n.target, torch._ops.HigherOrderOperator)),
    Rule("symbolic size arithmetic", lambda n, qg: n.target in (operator.add, operator.sub, operator.mul, operator.floordiv, operator.ge, operator.le, operator.lt, operator.gt, operator.eq, operator.ne, torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not, torch._assert) or getattr(n.target, "__module__", "") in ("torch._refs", "torch.fx.experimental.symbolic_shapes", "torch.utils._sym_node")),
    Rule("MoE routing record/replay (qpass.moe.routing)", lambda n, qg: _qpass_name(n) in MODEL_QPASS_OPS),
    Rule(
        "learner quantization op on the learner side",
        lambda n, qg: _qpass_name(n) in LEARNER_QPASS_OPS and qg.side in ("learner", "base"),
    ),
    Rule(
        "rollout quantization op (with matching site argument) on the rollout side",
        lambda n, qg: _qpass_name(n) in ROLLOUT_QPASS_OPS and qg.side == "rollout" and _site_arg_matches(n),
    ),
]


def first_rejected(qg: QGraph, rules: list[Rule] = RULES) -> torch.fx.Node | None:
    """The first ``call_function`` node no rule accepts, or None."""
    for node in qg.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if not any(r.accepts(node, qg) for r in rules):
            return node
    return None


def verify(qg: QGraph, rules: list[Rule] = RULES) -> None:
    """Lint the graph and apply the rules.

    Raises:
        VerificationError: lint failure, or the first node no rule accepts (named with its target,
            site and the rules tried).
    """
    try:
        qg.gm.graph.lint()
    except Exception as exc:  # noqa: BLE001
        raise VerificationError(f"{qg.side} {qg.kind} graph fails lint: {exc}") from exc
    node = first_rejected(qg, rules)
    if node is not None:
        raise VerificationError(
            f"{qg.side} {qg.kind} graph: node {node.name} (target {node.target}, site "
            f"{node.meta.get('qpass_site', '?')!r}) is accepted by no verifier rule; rules: {[r.name for r in rules]}"
        )
