"""Strict YAML for qpass's hand-written inputs (recipes): one document of plain data, checked as it is read.

``yaml.safe_load`` implements YAML 1.1, which is lenient where a config must be strict: ``yes`` /
``no`` / ``on`` / ``off`` are booleans (and pydantic then turns ``True`` into ``1.0``), ``010`` is
octal 8, ``1:30`` is the sexagesimal integer 90, a repeated key silently replaces the first, and
aliases expand without bound (a 1 KB "billion laughs" file becomes gigabytes in memory).

Rules enforced here (each violation raises the caller's error class, message ``path:line: ...``):

* input bytes are UTF-8 (a leading BOM is dropped); a bad byte is named with its offset, line and
  column (:func:`decode_utf8`); a file larger than :data:`MAX_BYTES` is refused;
* scalars resolve by the YAML 1.2 core schema: ``true``/``false`` (three spellings each), ``null``
  / ``~`` / empty, decimal / ``0o`` / ``0x`` integers, floats with a ``.`` or an exponent, ``.inf``,
  ``.nan``; every other plain scalar is a string (``yes`` is the string ``'yes'``);
* explicit tags other than the core ones (``!!str !!int !!float !!bool !!null !!seq !!map``) are
  refused, and so are anchors and aliases (hence merge keys): nothing expands;
* mapping keys are plain string scalars; a repeated key is refused naming both lines;
* nesting deeper than :data:`MAX_DEPTH` is refused; non-finite floats (``.inf``, ``.nan``) are
  refused by :func:`to_python` unless ``finite=False``.

Source: YAML 1.2.2 §10.3 (core schema); issue 31 (strict recipe loader).
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.events import AliasEvent
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import BaseResolver
from yaml.scanner import Scanner

__all__ = ["MAX_BYTES", "MAX_DEPTH", "YAML11_BOOLEANS", "compose", "decode_utf8", "kind_of", "loc", "to_python"]

MAX_BYTES = 1 << 20  # recipes are a few hundred bytes; anything this large is not one
MAX_DEPTH = 32
#: Plain scalars YAML 1.1 (PyYAML) reads as booleans but YAML 1.2 (this module) keeps as strings.
YAML11_BOOLEANS = frozenset({"yes", "no", "on", "off", "y", "n"})

T = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL, SEQ, MAP = (T + k for k in ("str", "int", "float", "bool", "null", "seq", "map"))
_CORE_TAGS = frozenset({STR, INT, FLOAT, BOOL, NULL, SEQ, MAP})

_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL_RE = re.compile(r"^(?:~|null|Null|NULL|)$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_RE = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


class _CoreResolver(BaseResolver):
    """YAML 1.2 core schema implicit resolution (BaseResolver has none of PyYAML's 1.1 rules)."""


_CoreResolver.add_implicit_resolver(BOOL, _BOOL_RE, list("tTfF"))
_CoreResolver.add_implicit_resolver(NULL, _NULL_RE, ["~", "n", "N", ""])
_CoreResolver.add_implicit_resolver(INT, _INT_RE, list("-+0123456789"))  # before float: "5" is an int
_CoreResolver.add_implicit_resolver(FLOAT, _FLOAT_RE, list("-+0123456789."))


class _Refused(Exception):
    def __init__(self, mark: Any, what: str) -> None:
        super().__init__(what)
        self.mark, self.what = mark, what


class _Loader(Reader, Scanner, Parser, Composer, _CoreResolver):
    """PyYAML's reader/scanner/parser/composer with the core resolver; anchors and aliases refused
    while composing, before anything could be expanded."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        _CoreResolver.__init__(self)

    def compose_node(self, parent: Any, index: Any) -> Any:
        ev = self.peek_event()
        if isinstance(ev, AliasEvent):
            raise _Refused(ev.start_mark, f"YAML alias *{ev.anchor} is not allowed (anchors and aliases are refused: "
                                          "write the value out)")
        if getattr(ev, "anchor", None) is not None:
            raise _Refused(ev.start_mark, f"YAML anchor &{ev.anchor} is not allowed (anchors and aliases are refused: "
                                          "write the value out)")
        return super().compose_node(parent, index)


def loc(path: str, node_or_mark: Any) -> str:
    """``path:line`` of a node (or a PyYAML mark); 1-based line."""
    mark = getattr(node_or_mark, "start_mark", node_or_mark)
    return f"{path}:{mark.line + 1}" if mark is not None else f"{path}:?"


def decode_utf8(data: bytes, path: str, *, error: type[Exception]) -> str:
    """``data`` as text (a leading UTF-8 BOM dropped).

    Raises:
        error: the size exceeds :data:`MAX_BYTES`, or a byte sequence is not UTF-8:
            ``path: not UTF-8 text: byte 0xe9 at offset 13 (line 2, column 6)``.
    """
    if len(data) > MAX_BYTES:
        raise error(f"{path}: {len(data)} bytes; a qpass YAML input is at most {MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise error(f"{path}: not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
                    f"(line {line}, column {col}): {exc.reason}; save the file as UTF-8") from None
    return text.removeprefix("\ufeff")


def compose(text: str, path: str, *, error: type[Exception]) -> yaml.Node | None:
    """Parse ``text`` (one YAML document) into a node tree checked by the module's rules.

    Returns:
        the root node, or None for an empty document.
    Raises:
        error: YAML syntax error, alias or anchor, a non-core tag, a non-string or repeated
            mapping key, nesting deeper than :data:`MAX_DEPTH`; the message starts ``path:line:``.
    """
    if len(text) > MAX_BYTES:
        raise error(f"{path}: {len(text)} characters; a qpass YAML input is at most {MAX_BYTES} bytes")
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
    except _Refused as exc:
        raise error(f"{loc(path, exc.mark)}: {exc.what}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{mark.line + 1}" if mark is not None else "?"
        problem = " ".join(x for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x) or str(exc)
        raise error(f"{path}:{where}: YAML syntax error: {problem}") from None
    except RecursionError:
        raise error(f"{path}: YAML nesting too deep (at most {MAX_DEPTH} levels)") from None
    finally:
        loader.dispose()
    if root is not None:
        _check_tree(root, path, error, 0)
    return root


def kind_of(node: yaml.Node) -> str:
    """What a node is, for messages: ``a mapping``, ``a list``, ``int '7'``, ``str 'x'``."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"{node.tag.rsplit(':', 1)[-1]} {node.value!r}"


def _check_tree(node: yaml.Node, path: str, error: type[Exception], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise error(f"{loc(path, node)}: YAML nesting too deep (at most {MAX_DEPTH} levels)")
    if node.tag not in _CORE_TAGS:
        raise error(f"{loc(path, node)}: YAML tag {node.tag!r} is not allowed (plain strings, numbers, booleans, "
                    "lists and mappings only)")
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode) or k.tag != STR:
                raise error(f"{loc(path, k)}: mapping keys must be plain strings, got {kind_of(k)}")
            if k.value in seen:
                raise error(f"{loc(path, k)}: duplicate key {k.value!r} (first at line {seen[k.value]}); "
                            "each key may appear once")
            seen[k.value] = k.start_mark.line + 1
            _check_tree(v, path, error, depth + 1)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_tree(item, path, error, depth + 1)


def to_python(node: yaml.Node | None, path: str, *, error: type[Exception], finite: bool = True) -> Any:
    """Plain Python data of a node from :func:`compose` (str, int, float, bool, None, list, dict).

    Raises:
        error: a scalar that does not fit its (explicit) tag, e.g. ``!!float yes``, an integer of
            more than 4000 digits, or (``finite``) ``.inf`` / ``.nan``.
    """
    if node is None:
        return None
    if isinstance(node, yaml.MappingNode):
        return {k.value: to_python(v, path, error=error, finite=finite) for k, v in node.value}
    if isinstance(node, yaml.SequenceNode):
        return [to_python(v, path, error=error, finite=finite) for v in node.value]
    v, tag = node.value, node.tag
    if tag == STR:
        return v
    if tag == NULL and _NULL_RE.match(v):
        return None
    if tag == BOOL and _BOOL_RE.match(v):
        return v.lower() == "true"
    if tag == INT and _INT_RE.match(v) and len(v) <= 4000:
        return int(v[2:], 8) if v.startswith("0o") else int(v[2:], 16) if v.startswith("0x") else int(v, 10)
    if tag == FLOAT and _FLOAT_RE.match(v):
        x = float(v.lower().replace(".inf", "inf").replace(".nan", "nan"))
        if finite and not math.isfinite(x):
            raise error(f"{loc(path, node)}: {v!r} is not a finite number")
        return x
    raise error(f"{loc(path, node)}: {v!r} is not a valid {tag.rsplit(':', 1)[-1]}")
