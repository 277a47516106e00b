"""Run-time switches of the Triton backend.

``sync_checks``: host-side validation that needs a device->host sync (NaN/inf input, stale amax,
out-of-range static RAC channels). On by default so bad input raises :class:`QuantizationError`
like the reference; off inside CUDA-graph capture (a sync is illegal there), under
:func:`no_sync_checks`, or with ``QPASS_TRITON_SYNC_CHECKS=0``. Without the checks a non-finite
activation propagates to NaN outputs instead of raising (never a silent finite code).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

_SYNC: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qpass_triton_sync_checks", default=os.environ.get("QPASS_TRITON_SYNC_CHECKS", "1") != "0"
)


def sync_checks_enabled(device: torch.device) -> bool:
    """Whether host-syncing validation should run now for tensors on ``device``."""
    if not _SYNC.get():
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


@contextlib.contextmanager
def no_sync_checks() -> Iterator[None]:
    """Disable host-syncing validation in this context (decode loops, CUDA graphs, benchmarks)."""
    token = _SYNC.set(False)
    try:
        yield
    finally:
        _SYNC.reset(token)
