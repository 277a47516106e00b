"""Named arguments of custom-op call nodes, from the op schema (no positional ``args[i]`` reads).

    op_args(node)["site"]                       # instead of node.args[5]
    set_op_args(node, rac_ratio=0.5, ...)       # instead of args[7:11] = [...]
"""

from __future__ import annotations

from typing import Any

import torch

from qpass.errors import QpassError


def _schema(node: torch.fx.Node) -> Any:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        raise QpassError(f"node {node.name} (target {node.target}) is not a torch op with a schema")
    return schema


def op_name(node: torch.fx.Node) -> str | None:
    """``namespace::name`` of an op-overload call node, else None."""
    t = node.target
    return t.name() if isinstance(t, torch._ops.OpOverload) else None


def op_args(node: torch.fx.Node) -> dict[str, Any]:
    """``{argument name: value}`` of a call node, positional and keyword args bound to the schema
    (defaults filled in).

    Raises:
        QpassError: the target has no schema, or an argument has no value and no default.
    """
    schema = _schema(node)
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            raise QpassError(f"node {node.name} ({node.target}): argument {a.name!r} has no value")
    return out


def args_in_schema_order(target: Any, named: dict[str, Any]) -> tuple[Any, ...]:
    """Positional argument tuple for ``target`` from ``{name: value}``.

    Raises:
        QpassError: a name the schema does not have, or a missing argument without default.
    """
    schema = target._schema
    names = [a.name for a in schema.arguments]
    unknown = set(named) - set(names)
    if unknown:
        raise QpassError(f"{target}: unknown arguments {sorted(unknown)}; schema has {names}")
    out = []
    for a in schema.arguments:
        if a.name in named:
            out.append(named[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise QpassError(f"{target}: argument {a.name!r} is required")
    return tuple(out)


def set_op_args(node: torch.fx.Node, **updates: Any) -> None:
    """Rewrite named arguments of a call node in place (stored positionally, schema order)."""
    named = op_args(node)
    named.update(updates)
    node.args = args_in_schema_order(node.target, named)
    node.kwargs = {}
