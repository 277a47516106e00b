"""Route ``qpass::nvfp4_linear`` calls of the ``triton`` kernel backend through the CUDA kernels.

``install()`` wraps the Triton backend's table entry: every call is offered to
:func:`qpass.backends.cuda.ops.nvfp4_linear` first (when ``ENABLED["on"]``), and the Triton kernel
runs whatever the CUDA routes do not take. Engines capture the path taken at capture time (CUDA
graphs), so switch ``ENABLED`` before building an engine, not while one runs.
"""

from __future__ import annotations

from qpass.backends.cuda import ops as cuda_ops

ENABLED = {"on": True}
_STATE: dict = {}


def install() -> None:
    """Wrap the ``(qpass::nvfp4_linear, NVFP4Spec, "triton")`` kernel (idempotent)."""
    import qpass.backends.triton.registry  # noqa: F401 (registers the Triton kernels)
    from qpass.formats.spec import NVFP4Spec
    from qpass.tables import TABLES

    key = ("qpass::nvfp4_linear", NVFP4Spec, "triton")
    if "orig" in _STATE:
        return
    orig = TABLES["kernels"][key]
    _STATE["orig"] = orig
    _STATE["hits"] = 0

    def routed(call):
        if ENABLED["on"]:
            y = cuda_ops.nvfp4_linear(call)
            if y is not None:
                _STATE["hits"] += 1
                return y
        return orig(call)

    TABLES["kernels"][key] = routed


def hits() -> int:
    return int(_STATE.get("hits", 0))
