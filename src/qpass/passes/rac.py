"""Deprecated import path, kept for one release: this name *is* :mod:`qpass.compiler.passes.residual_compensation` (the same module
object, so classes, registries and monkeypatching are shared). New code imports ``qpass.compiler.passes.residual_compensation``
(tests/test_import_map.py forbids new src uses of this path)."""

import sys

import qpass.compiler.passes.residual_compensation as _target

sys.modules[__name__] = _target
