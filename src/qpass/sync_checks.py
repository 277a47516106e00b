"""The one switch for value checks that synchronise with the host, for every backend.

Checks of *values* (NaN/inf input, stale amax, E2M1 code range, static RAC channel range) read a
device tensor on the host, which a CUDA graph capture forbids and which stalls the stream in a decode
loop. :func:`sync_checks_enabled` is on by default and off inside CUDA-graph capture
(``torch.cuda.is_current_stream_capturing()``), under :func:`no_sync_checks`, or with
``QPASS_SYNC_CHECKS=0`` (``QPASS_TRITON_SYNC_CHECKS=0``, its older name, still works). Without the
value checks a non-finite activation gives NaN outputs (its amax, hence its global scale, is NaN),
never a silent finite code. A leaf module (imports only torch) so that ``qpass.formats`` can use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

__all__ = ["no_sync_checks", "sync_checks_enabled"]


def _default() -> bool:
    return os.environ.get("QPASS_SYNC_CHECKS", os.environ.get("QPASS_TRITON_SYNC_CHECKS", "1")) != "0"


_SYNC: contextvars.ContextVar[bool] = contextvars.ContextVar("qpass_sync_checks", default=_default())


def sync_checks_enabled(device: torch.device | str) -> bool:
    """Whether value checks that synchronise with the host should run now for tensors on ``device``."""
    if not _SYNC.get():
        return False
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


@contextlib.contextmanager
def no_sync_checks() -> Iterator[None]:
    """Skip host-syncing value checks in this context (decode loops, CUDA graphs, benchmarks)."""
    token = _SYNC.set(False)
    try:
        yield
    finally:
        _SYNC.reset(token)
