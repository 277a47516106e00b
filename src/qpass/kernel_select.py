"""Which kernel backend is in effect: the context variable behind :func:`qpass.ops.use_kernels`.

One concept, no qpass imports, so that the lowest layer (:mod:`qpass.tables`, whose
:func:`~qpass.tables.backend_quantize` picks a backend's quantizer) can read the selection without
importing :mod:`qpass.ops` (which imports the quantizers: an import cycle). :mod:`qpass.ops`
re-exports :func:`current_backend` and :func:`effective_backend` and owns the setters, which check
that the backend has registered kernels.
"""

from __future__ import annotations

import contextvars
import os

import torch

BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("qpass_kernel_backend", default="reference")


def current_backend() -> str:
    """The kernel backend selected in this context (``"reference"`` unless a caller chose one)."""
    return BACKEND.get()


#: the rollout kernel backends a command's ``--kernels`` flag offers (one list for apply, check, grpo, study)
KERNEL_CHOICES: tuple[str, ...] = ("reference", "triton", "cuda")


def effective_backend(name: str, device: str | torch.device) -> str:
    """The kernels that will actually run for backend ``name`` on ``device``: ``triton`` off CUDA
    runs the reference ops unless ``TRITON_INTERPRET=1`` (the same rule as the dispatcher); ``cuda``
    (NVRTC kernels) off CUDA runs the reference ops."""
    cuda = torch.device(device).type == "cuda"
    if name == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "reference"
    if name == "cuda" and not cuda:
        return "reference"
    return name
