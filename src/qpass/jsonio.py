"""The one JSON writer of qpass (reports, bench/selfcheck results, study, GRPO logs).

NaN policy (one for every file qpass writes): strict JSON only — no ``NaN``/``Infinity`` tokens.
A non-finite float becomes ``null``; when it is the value of a mapping key ``k``, a sibling key
``k_reason`` says what was there (``"non-finite: nan"``; for a list value, which positions:
``"non-finite: nan at [0], inf at [3]"``). Other conversions: tensors / numpy values through
``.item()`` (0-d) or ``.tolist()``; tuples and sets to lists (sets sorted); ``Path`` to str;
dataclasses to dicts; mapping keys to str; anything else unknown to ``str(value)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qpass.atomic import write_atomic

__all__ = ["REASON_SUFFIX", "dumps", "json_safe", "write_json"]

REASON_SUFFIX = "_reason"


def _nonfinite(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _safe(value: Any, path: str, bad: list[str]) -> Any:
    """Convert ``value``; non-finite floats found outside nested mappings are appended to ``bad``."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        bad.append(f"{_nonfinite(value)}{' at ' + path if path else ''}")
        return None
    if isinstance(value, Mapping):
        return _safe_mapping(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _safe_mapping(dataclasses.asdict(value))
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    if isinstance(value, (list, tuple)):
        return [_safe(v, f"{path}[{i}]", bad) for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    if callable(item) and (not callable(numel) or numel() == 1) and getattr(value, "ndim", 0) == 0:
        try:
            return _safe(item(), path, bad)
        except (ValueError, RuntimeError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return _safe(tolist(), path, bad)
    return str(value)


def _safe_mapping(m: Mapping) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    for k, v in m.items():
        bad: list[str] = []
        key = str(k)
        out[key] = _safe(v, "", bad)
        if bad:
            reasons[key + REASON_SUFFIX] = "non-finite: " + ", ".join(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
    for rk, rv in reasons.items():
        out.setdefault(rk, rv)
    return out


def json_safe(value: Any) -> Any:
    """A copy of ``value`` that ``json.dumps(..., allow_nan=False)`` accepts (see module docstring).

    A non-finite float that is not inside a mapping (a bare scalar, or a list at top level) becomes
    ``null`` with no reason key (there is no mapping to put it in).
    """
    return _safe(value, "", [])


def dumps(value: Any, *, indent: int | None = 2, compact: bool = False) -> str:
    """Strict JSON text of ``value`` after :func:`json_safe` (``compact``: no spaces, one line)."""
    if compact:
        return json.dumps(json_safe(value), allow_nan=False, separators=(",", ":"))
    return json.dumps(json_safe(value), allow_nan=False, indent=indent)


def write_json(path: str | Path, value: Any, *, indent: int | None = 2) -> None:
    """Write :func:`dumps` of ``value`` (plus a newline) to ``path`` atomically (temp file + rename)."""
    write_atomic(path, dumps(value, indent=indent) + "\n")
