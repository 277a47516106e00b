"""The backend seam: what a qpass backend is and how it plugs in.

A backend (Triton kernels, ONNX emitters, the SGLang plugin, the Megatron learner hooks, or a
third-party package) is an object satisfying :class:`Backend`. The app layer registers backends
through **one** path, :func:`qpass.apps.plugins.load_backends`, which takes the built-in ones from
:mod:`qpass.backends.catalog` and third-party ones from the ``qpass.backends`` entry-point group.
``register()`` puts the backend's entries into the core tables (kernels, ONNX lowerings, engine
factories) — the core never imports a backend.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Protocol, runtime_checkable

from qpass.errors import QpassError

__all__ = ["Backend", "BackendUnavailable", "ModuleBackend"]


class BackendUnavailable(QpassError):
    """A backend was asked for whose dependencies are not installed (the message has the install hint)."""


@runtime_checkable
class Backend(Protocol):
    """A pluggable backend.

    Attributes:
        name: unique short name (``triton``, ``onnx``, ``sglang``, ``megatron``, ...); for kernel
            backends also the name ``qpass.ops.use_kernels`` takes.
        install_hint: what to install when :meth:`available` is False (e.g. ``pip install 'qpass[triton]'``).
    """

    name: str
    install_hint: str

    def available(self) -> bool:
        """True if the backend's dependencies import here (cheap; imports nothing heavy)."""
        ...

    def register(self) -> None:
        """Put the backend's entries into the core tables (idempotent).

        Raises:
            BackendUnavailable: the dependencies are missing (message names them and the install hint).
        """
        ...


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or a broken one
        return False


@dataclasses.dataclass(frozen=True)
class ModuleBackend:
    """A :class:`Backend` whose registration is importing a module (its import-time
    ``@register(...)`` decorators fill the core tables), plus an optional hook.

    Attributes:
        name, install_hint: see :class:`Backend`.
        module: the module whose import registers the entries, e.g. ``qpass.backends.triton.registry``.
        requires: top-level modules that must be importable for :meth:`available`.
        hook: optional ``"module:function"`` called (no arguments) after the import, e.g. the
            SGLang plugin's own registration with SGLang.
    """

    name: str
    module: str
    requires: tuple[str, ...]
    install_hint: str
    hook: str | None = None

    def available(self) -> bool:
        return all(_importable(m) for m in self.requires)

    def register(self) -> None:
        if not self.available():
            missing = [m for m in self.requires if not _importable(m)]
            raise BackendUnavailable(f"backend {self.name!r} needs {', '.join(missing)}: {self.install_hint}")
        importlib.import_module(self.module)
        if self.hook:
            mod, _, fn = self.hook.partition(":")
            getattr(importlib.import_module(mod), fn)()
