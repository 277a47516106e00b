"""Input validation shared by every quantizer: one place that turns bad input into a named error.

Value checks (NaN/inf, stale amax, code and channel ranges) read a tensor back to the host; they
run only while :func:`qpass.sync_checks.sync_checks_enabled` says so (off under CUDA-graph capture).
Checks of shapes and dtypes never sync and always run.
"""

from __future__ import annotations

import torch

from qpass.errors import QuantizationError
from qpass.sync_checks import no_sync_checks, sync_checks_enabled

__all__ = ["FLOAT_INPUT_DTYPES", "check_float_input", "describe", "no_sync_checks", "sync_checks_enabled"]

FLOAT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def describe(name: str | None, site: str | None) -> str:
    """``tensor 'w' at site model.layers.3.mlp.down_proj`` (whichever parts are known)."""
    parts = []
    if name:
        parts.append(f"tensor {name!r}")
    if site:
        parts.append(f"at site {site}")
    return " ".join(parts) if parts else "input tensor"


def check_float_input(
    x: torch.Tensor,
    *,
    op: str,
    multiple_of: int | None = None,
    min_dim: int = 2,
    name: str | None = None,
    site: str | None = None,
    finite: bool = True,
) -> None:
    """Reject input a quantizer cannot encode faithfully.

    Args:
        x: the tensor to quantize.
        op: quantizer name for the message (``nvfp4_quantize``...).
        multiple_of: required divisor of the last dimension (16 for NVFP4, 32 for MXFP4).
        min_dim: smallest accepted ``x.dim()``.
        name, site: what to call the tensor in the message.
        finite: also check for NaN/inf (reads ``x`` back: a sync). False where the caller checks
            finiteness itself (the Triton quantizers, through amax bits): then nothing syncs.
    Raises:
        QuantizationError: not a tensor; integer/bool/complex/float64 dtype; fewer than ``min_dim``
            dims; zero elements; last dim not a multiple of ``multiple_of``; with ``finite``, any NaN
            or +-inf (the message gives the count and the first index).
    """
    where = describe(name, site)
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"{op} expects a torch.Tensor, got {type(x).__name__} for {where}")
    if x.dtype not in FLOAT_INPUT_DTYPES:
        hint = " (cast it to float32 first: qpass never rounds float64 implicitly)" if x.dtype == torch.float64 else ""
        raise QuantizationError(
            f"{op} expects bf16/fp16/fp32 input, got dtype={x.dtype} for {where}{hint}"
        )
    if x.dim() < min_dim:
        raise QuantizationError(
            f"{op} expects a tensor with at least {min_dim} dims [rows, k], got shape={tuple(x.shape)} for {where}"
        )
    if x.numel() == 0:
        raise QuantizationError(f"{op} got an empty tensor, shape={tuple(x.shape)} for {where}")
    if multiple_of and x.shape[-1] % multiple_of:
        raise QuantizationError(
            f"k must be a multiple of {multiple_of}, got x.shape={tuple(x.shape)} for {where} "
            f"({op}; pad whole blocks with zeros explicitly if that is what you want)"
        )
    if not finite or not sync_checks_enabled(x.device):
        return
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = (~finite).nonzero()
        first = tuple(int(i) for i in bad[0])
        val = x[first].item()
        raise QuantizationError(
            f"{op}: {bad.shape[0]} non-finite value(s) in {where}, first at index {first} = {val} "
            f"(NaN/inf has no NVFP4/FP8 code; qpass refuses instead of emitting a silent code)"
        )
