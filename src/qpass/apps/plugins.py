"""The one registration path for backends: the app layer calls :func:`load_backends`.

Sources, in order: the built-in backends (:mod:`qpass.backends.catalog`), then third-party ones
from the ``qpass.backends`` entry-point group. An entry point names a
:class:`~qpass.backends.base.Backend` object or a zero-argument callable returning one, e.g. in a
plugin's ``pyproject.toml``::

    [project.entry-points."qpass.backends"]
    mykernels = "mypkg.qpass_backend:BACKEND"

Registration is idempotent and happens only here — never from ``qpass.ops``, the spec tables or
any other core module.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterable

from qpass.backends.base import Backend, BackendUnavailable
from qpass.errors import QpassError

__all__ = ["ENTRY_POINT_GROUP", "BackendUnavailable", "discover_backends", "load_backends", "registered_backends"]

ENTRY_POINT_GROUP = "qpass.backends"
_REGISTERED: dict[str, Backend] = {}
log = logging.getLogger(__name__)


def discover_backends() -> dict[str, Backend]:
    """Every known backend by name: built-in first, then entry points (a third-party backend may not
    reuse a built-in name).

    Raises:
        QpassError: an entry point does not load, is not a :class:`Backend`, or reuses a taken name
            (the message names the entry point).
    """
    from qpass.backends.catalog import BUILTIN

    found: dict[str, Backend] = {b.name: b for b in BUILTIN}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name!r} ({ep.value}) in group {ENTRY_POINT_GROUP!r}"
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin is named, not a traceback
            raise QpassError(f"{where} failed to load: {e!r}") from e
        if not isinstance(obj, Backend) and callable(obj):
            obj = obj()
        if not isinstance(obj, Backend):
            raise QpassError(f"{where} is not a qpass Backend (needs name, install_hint, available(), register()): {obj!r}")
        if obj.name in found and found[obj.name] is not obj:
            raise QpassError(f"{where} uses the backend name {obj.name!r}, which is taken")
        found[obj.name] = obj
    return found


def load_backends(names: Iterable[str] | None = None) -> dict[str, Backend]:
    """Register backends into the core tables.

    Args:
        names: the backends to register; each must exist and be available. ``None``: every
            available backend (unavailable ones are skipped and logged at debug level).
    Returns:
        the backends registered so far in this process, by name.
    Raises:
        QpassError: an unknown name (lists the known ones).
        BackendUnavailable: a named backend's dependencies are missing (with its install hint).
    """
    known = discover_backends()
    if names is None:
        todo = [b for b in known.values() if b.available()]
        for b in known.values():
            if not b.available():
                log.debug("backend %s not available: %s", b.name, b.install_hint)
    else:
        todo = []
        for n in names:
            if n == "reference":  # the plain-torch kernels are part of the core
                continue
            if n not in known:
                raise QpassError(f"unknown backend {n!r}; known: {sorted(known)}")
            if not known[n].available():
                raise BackendUnavailable(f"backend {n!r} is not installed here: {known[n].install_hint}")
            todo.append(known[n])
    for b in todo:
        if b.name not in _REGISTERED:
            b.register()
            _REGISTERED[b.name] = b
    return dict(_REGISTERED)


def registered_backends() -> list[str]:
    """Names registered through :func:`load_backends` in this process."""
    return sorted(_REGISTERED)
