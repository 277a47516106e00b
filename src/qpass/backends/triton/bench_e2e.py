"""Deprecated path of :mod:`qpass.apps.bench.e2e`:
an alias of that module (moved out of the backend, issue 33).

New code imports the new path (the import map rejects this one).
"""

from qpass._moved import moved

moved(__name__, "qpass.backends.triton.bench_e2e", "qpass.apps.bench.e2e")
