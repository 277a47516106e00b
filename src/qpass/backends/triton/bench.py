"""Deprecated path of :mod:`qpass.apps.bench.triton_bench`:
an alias of that module (moved out of the backend, issue 33).

``python -m`` runs ``qpass bench``;
new code imports the new path (the import map rejects this one).
"""

from qpass._moved import moved

moved(__name__, "qpass.backends.triton.bench", "qpass.apps.bench.triton_bench")
