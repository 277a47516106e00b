"""Route ``qpass::nvfp4_linear`` calls of the ``triton`` kernel backend through the CUDA kernels.

``install()`` wraps the Triton backend's table entry: every call is offered to
:func:`qpass.backends.cuda.ops.nvfp4_linear` first (when ``ENABLED["on"]``), and the Triton kernel
runs whatever the CUDA routes do not take. Engines capture the path taken at capture time (CUDA
graphs), so switch ``ENABLED`` before building an engine, not while one runs.
"""

from __future__ import annotations

import types

from qpass.backends.cuda import ops as cuda_ops

ENABLED = {"on": True}
_STATE: dict = {}


def _call_of(x, w_codes, w_scales, w_s_dec, bias, site, act, rac_ratio, rac_mode, rac_selection, rac_channels):
    from qpass.quant.nvfp4 import nvfp4_act_spec
    from qpass.quant.rac import RACConfig, rac_num_channels

    k = x.shape[-1]
    w4a16 = act == "none"
    rac = None if w4a16 or rac_ratio <= 0 else RACConfig(rac_ratio, rac_mode, rac_selection)
    rac_k = rac_num_channels(k, rac.ratio) if rac is not None else 0
    if rac_k == 0:
        rac = None
    return types.SimpleNamespace(
        x=x, weight=types.SimpleNamespace(codes=w_codes, scales=w_scales, s_dec=w_s_dec), bias=bias,
        act=None if w4a16 else nvfp4_act_spec(act == "nvfp4_per_token"), rac=rac, rac_k=rac_k,
        rac_channels=rac_channels if rac is not None and rac.selection == "static" else None, site=site,
        out_dtype=x.dtype, in_features=k, w4a16=w4a16, per_token=act == "nvfp4_per_token")


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

    def routed(*args):
        if ENABLED["on"]:
            y = cuda_ops.nvfp4_linear(_call_of(*args))
            if y is not None:
                _STATE["hits"] += 1
                return y
        return orig(*args)

    TABLES["kernels"][key] = routed


def hits() -> int:
    return int(_STATE.get("hits", 0))
