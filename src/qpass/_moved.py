"""Old import paths of moved modules: one call turns a shim file into an alias of the new module.

A shim is a module left at a moved module's old path whose whole body is
``moved(__name__, "<old path>", "<new path>")``. ``scripts/import_map.py`` reads these calls (with
``ast``): it records the alias edge, exempts only that edge from the layer rules, and reports every
other module that imports an old path (rule "moved"). A leaf module: it imports nothing from qpass.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def moved(name: str, old: str, new: str) -> None:
    """Make the shim ``old`` stand for module ``new``.

    Args:
        name: the shim's ``__name__`` (``"__main__"`` under ``python -m <old>``).
        old: the shim's own dotted path (the moved module's old path).
        new: the dotted path of the module that now holds the code.

    Imported (``name == old``): ``sys.modules[old]`` becomes the module ``new`` itself, so attributes,
    monkeypatches and ``isinstance`` checks are shared; a ``DeprecationWarning`` names the new path.
    Run (``python -m <old> ARGS``): runs ``new`` as ``__main__`` exactly as ``python -m <new> ARGS``
    would (its ``if __name__ == "__main__"`` block, its exit status).

    Raises:
        ValueError: ``name`` is neither ``old`` nor ``"__main__"`` (the call names the wrong shim).
    """
    if name == "__main__":
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    if name != old:
        raise ValueError(f"moved(): shim {name!r} declares old path {old!r}; they must be the same module")
    warnings.warn(f"{old} moved to {new}; import the new path", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
