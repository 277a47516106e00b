"""Deprecated path of :mod:`qpass.apps.bench.aot`:
an alias of that module (moved out of the backend, issue 33).

``python -m`` runs the sm_90 compile report;
new code imports the new path (the import map rejects this one).
"""

from qpass._moved import moved

moved(__name__, "qpass.backends.triton.aot", "qpass.apps.bench.aot")
