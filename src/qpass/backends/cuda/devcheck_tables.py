"""Deprecated path of :mod:`qpass.apps.bench.cuda_tables` (the tables of a devcheck run): an alias of that module
(tooling moved out of the backend, issue 33).

``python -m`` runs it (the GPU-box commands in docs/results call it so); new code imports the new path
(the import map rejects this one).
"""

from qpass._moved import moved

moved(__name__, "qpass.backends.cuda.devcheck_tables", "qpass.apps.bench.cuda_tables")
