"""The learner's logits at a window of positions only: the scoring graph split at its output projection.

GRPO uses the learner's log-probs only at the ``R`` positions that predict response tokens, yet the
scoring graph applies the output projection (``lm_head``, a ``[V, H]`` matmul: V = 49152, H = 576 on
SmolLM2-135M) at all ``B * T`` positions, and its backward at all of them too. :func:`split_at_head`
copies the graph up to the projection's input (the *trunk*, sharing the graph's parameters) and
:meth:`HeadSplit.window_logits` applies the projection, the same op with the same operands, to the
window's rows only::

    before:  ... -> norm -> alias [B, T, H] -> aten.linear(., W) [B, T, V] -> output      (then [:, a:b])
    trunk:   ... -> norm -> alias [B, T, H] -> output (alias, W)
    window:  aten.linear(alias[:, a:b], W) [B, b - a, V]

Only a head op that acts on each row of its input alone is split (:data:`ROW_WISE_HEADS`); any other
graph gets None and its caller keeps the full computation. Row-wise is exact in real arithmetic; in
floating point a GEMM's result for a row may depend on how many rows it is given (blocking), so the
equality with ``full[:, a:b]`` is measured, not assumed (tests/test_head_window.py; on the 2-core
AVX2 CPU bit-identical for the GRPO shapes). Gradient reaches the trunk only through the window's rows,
as it did through the slice of the full logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

__all__ = ["HeadSplit", "ROW_WISE_HEADS", "split_at_head"]

#: Output-projection ops :func:`split_at_head` splits: their first argument's rows are independent
#: (row i of the output is a function of row i of the input and the other operands only).
ROW_WISE_HEADS = (torch.ops.aten.linear.default,)


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """A scoring graph split at its output projection (:func:`split_at_head`).

    Attributes:
        gm: the graph module it was split from (its parameters are the trunk's).
        trunk: ``(input_ids, attention_mask, position_ids) -> (hidden [B, T, H], *operands)``: every
            node of ``gm`` but the head, returning the head's input and its other tensor operands.
        head: the head node's op (one of :data:`ROW_WISE_HEADS`).
        args, kwargs: the head's arguments with ``("hidden",)`` / ``("operand", i)`` markers for trunk outputs.
        attrs: ``(target, object)`` of every attribute the trunk reads, to tell whether it is still ``gm``'s.
    """

    gm: torch.fx.GraphModule
    trunk: torch.fx.GraphModule
    head: Any
    args: tuple
    kwargs: dict
    attrs: tuple[tuple[str, Any], ...]

    def current(self, gm: torch.fx.GraphModule) -> bool:
        """The split is of ``gm`` and every attribute it reads is still the object ``gm`` holds."""
        return gm is self.gm and all(_resolve(gm, t) is o for t, o in self.attrs)

    def window_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      start: int, stop: int) -> torch.Tensor:
        """Logits ``[B, stop - start, V]`` (model dtype) of positions ``start .. stop - 1``.

        Args:
            input_ids, attention_mask, position_ids: int64 ``[B, T]``, as the graph takes them.
            start, stop: ``0 <= start <= stop <= T``.
        Returns:
            ``head(hidden[:, start:stop], *operands)``: in real arithmetic ``gm(...)[:, start:stop]``.
        Raises:
            ValueError: the window is outside ``[0, T]`` or the head's input is not ``[B, T, H]``.
        """
        t = int(input_ids.shape[1])
        if not 0 <= start <= stop <= t:
            raise ValueError(f"window [{start}, {stop}) is outside the sequence of length {t}")
        hidden, *operands = self.trunk(input_ids, attention_mask, position_ids)
        if hidden.dim() != 3 or int(hidden.shape[1]) != t:
            raise ValueError(f"the head's input must be [B, T={t}, H], got {tuple(hidden.shape)}")
        rows = hidden[:, start:stop]

        def fill(a: Any) -> Any:
            if isinstance(a, tuple) and a and a[0] == "hidden":
                return rows
            if isinstance(a, tuple) and a and a[0] == "operand":
                return operands[a[1]]
            return a

        return self.head(*(fill(a) for a in self.args), **{k: fill(v) for k, v in self.kwargs.items()})


def _resolve(mod: torch.nn.Module, target: str) -> Any:
    obj: Any = mod
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def split_at_head(gm: torch.fx.GraphModule) -> HeadSplit | None:
    """Split ``gm`` (a scoring graph: ``(input_ids, attention_mask, position_ids) -> logits``) at its
    output projection.

    Returns:
        a :class:`HeadSplit`, or None when the graph's one output is not a :data:`ROW_WISE_HEADS` op
        used by the output only, whose first argument is a graph value (the caller then computes the
        full logits).
    """
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = out.args[0]
    if not (isinstance(vals, (tuple, list)) and len(vals) == 1 and isinstance(vals[0], torch.fx.Node)):
        return None
    head = vals[0]
    if head.op != "call_function" or head.target not in ROW_WISE_HEADS or len(head.users) != 1 or not head.args \
            or not isinstance(head.args[0], torch.fx.Node):
        return None
    x = head.args[0]
    operands: list[torch.fx.Node] = []

    def mark(a: Any) -> Any:
        if a is x:
            return ("hidden",)
        if isinstance(a, torch.fx.Node):
            operands.append(a)
            return ("operand", len(operands) - 1)
        if isinstance(a, (list, tuple)) and any(isinstance(e, torch.fx.Node) for e in a):
            raise _Unsplittable
        return a

    try:
        args = (("hidden",), *(mark(a) for a in head.args[1:]))
        kwargs = {k: mark(v) for k, v in head.kwargs.items()}
    except _Unsplittable:
        return None
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output" or n is head:
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output((env[x], *(env[o] for o in operands)))
    trunk = torch.fx.GraphModule(gm, g, class_name="ScoringTrunk")
    attrs = tuple((n.target, _resolve(gm, n.target)) for n in g.nodes if n.op in ("get_attr", "call_module"))
    return HeadSplit(gm, trunk, head.target, args, kwargs, attrs)


class _Unsplittable(Exception):
    """A head argument nests graph values (not split)."""
