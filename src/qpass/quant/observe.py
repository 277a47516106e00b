"""Observe the input amax of the rollout's NVFP4 linears while they run (static-scale staleness).

``qpass::nvfp4_linear`` calls :func:`record` with its input; inside ``with observe_input_amax() as
tape:`` each call folds ``max|x|`` (float32, on the input's device, no host sync) into
``tape.amax[site]`` and counts the call. Outside such a block :func:`record` does nothing. Calls made
while a CUDA graph is being captured are not recorded (their replays run no Python: a decode step
replayed from a CUDA graph is not observed; ``tape.calls`` says how many calls were).

Used by ``qpass grpo`` to report how stale the calibrated activation scales are: the amax the rollout
saw during sampling against the calibrated one (:func:`qpass.calibration.staleness`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass
class AmaxTape:
    """What one observation block saw.

    Attributes:
        amax: per site, float32 0-d ``max|x|`` over every recorded call.
        calls: per site, the number of recorded calls.
    """

    amax: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)


_TAPE: contextvars.ContextVar[AmaxTape | None] = contextvars.ContextVar("qpass_amax_tape", default=None)


@contextlib.contextmanager
def observe_input_amax() -> Iterator[AmaxTape]:
    """``with observe_input_amax() as tape:`` every ``qpass::nvfp4_linear`` call inside records its input amax."""
    tape = AmaxTape()
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def record(site: str, x: torch.Tensor) -> None:
    """Fold ``max|x|`` into the active tape's entry for ``site`` (no-op without a tape or for an empty ``x``)."""
    tape = _TAPE.get()
    if tape is None or x.numel() == 0 or _capturing(x):
        return
    a = x.detach().abs().amax().float()
    prev = tape.amax.get(site)
    tape.amax[site] = a if prev is None else torch.maximum(prev, a.to(prev.device))
    tape.calls[site] = tape.calls.get(site, 0) + 1
