"""Run-time switches of the Triton backend.

``sync_checks``: host-side validation that needs a device->host sync (NaN/inf input, stale amax,
out-of-range static RAC channels). The switch is shared with the reference backend and lives in
:mod:`qpass.sync_checks` (on by default; off inside CUDA-graph capture, under
:func:`no_sync_checks`, or with ``QPASS_SYNC_CHECKS=0`` / ``QPASS_TRITON_SYNC_CHECKS=0``). Without the
checks a non-finite activation propagates to NaN outputs instead of raising (never a silent finite
code).
"""

from __future__ import annotations

from qpass.sync_checks import no_sync_checks, sync_checks_enabled

__all__ = ["no_sync_checks", "sync_checks_enabled"]
