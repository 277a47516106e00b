"""Deprecated path of :mod:`qpass.apps.bench.moe_check`:
an alias of that module (moved out of the backend, issue 33).

``python -m`` runs the MoE check (GPU scripts call it so);
new code imports the new path (the import map rejects this one).
"""

from qpass._moved import moved

moved(__name__, "qpass.backends.triton.moe_check", "qpass.apps.bench.moe_check")
