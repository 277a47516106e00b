"""Detect device->host synchronisation in code that must be capturable as a CUDA graph, on any device.

A CUDA graph capture fails (``cudaErrorStreamCaptureUnsupported``) at the first op that reads a
device value on the host: ``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``, ``.tolist()``,
``nonzero`` / boolean-mask indexing (their output shape depends on the data), ``masked_select``,
``unique``; and it fails at the first host-to-device copy of pageable memory (``torch.tensor(data,
device=...)``, ``t[index] = python_scalar``). :func:`forbid_host_sync` raises at exactly those ops, also on CPU tensors, so a CPU test
can prove that a decode step would capture (the H200 is not needed to find the sync; it is
needed to prove the capture). It replaces those methods while active, so it sees every Python-level call
(qpass's reference kernels, custom-op implementations, a ``torch.export`` graph module), not what a
C++ kernel does internally.

Source: PyTorch "CUDA Graphs" notes (constraints: no CPU-GPU sync inside capture) and
``torch.cuda.set_sync_debug_mode`` (the CUDA-only runtime equivalent).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from qpass.errors import QpassError

__all__ = ["HostSyncError", "forbid_host_sync"]


class HostSyncError(QpassError):
    """An op that reads a device value on the host ran where a CUDA graph will be captured."""


_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "nonzero", "argwhere",
            "masked_select", "unique", "unique_consecutive", "numpy", "__getitem__", "__setitem__")
_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "tensor", "as_tensor")


def _bool_index(idx: object) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _tensor_index(idx: object) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) for i in items)


def _guard(name: str, orig, where: str):  # noqa: ANN001, ANN202
    if name in ("__getitem__", "__setitem__"):
        def index(self, idx, *rest):  # noqa: ANN001, ANN202
            if _bool_index(idx):
                raise HostSyncError(f"{where}: boolean-mask {name} reads a device value on the host "
                                    "(its output shape depends on the data; a CUDA graph cannot capture it)")
            if name == "__setitem__" and _tensor_index(idx) and rest and not isinstance(rest[0], torch.Tensor):
                raise HostSyncError(f"{where}: t[tensor_index] = python scalar copies a host tensor to the device "
                                    "(index_put_ with a CPU value; use index_fill_ / scatter_)")
            return orig(self, idx, *rest)
        return index
    if name in ("tensor", "as_tensor"):
        def make(data, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if not isinstance(data, torch.Tensor) and str(kwargs.get("device", "cpu")) != "cpu":
                raise HostSyncError(f"{where}: torch.{name}(python data, device=...) copies host memory to the device")
            return orig(data, *args, **kwargs)
        return make

    def syncing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise HostSyncError(f"{where}: {name} reads a device value on the host (a CUDA graph cannot capture it)")
    return syncing


@contextlib.contextmanager
def forbid_host_sync(where: str = "code under capture") -> Iterator[None]:
    """Raise :class:`HostSyncError` (naming the op and ``where``) at any host-syncing tensor op.

    Replaces the syncing methods of ``torch.Tensor`` and functions of ``torch`` for the duration, so it
    also sees the Python implementations of custom ops (a ``TorchFunctionMode`` is switched off inside
    them). Process-global while active: for tests and probes, not for concurrent code.
    """
    saved: list[tuple[object, str, object]] = []
    try:
        for name in _METHODS:
            orig = getattr(torch.Tensor, name)
            saved.append((torch.Tensor, name, orig))
            setattr(torch.Tensor, name, _guard(name, orig, where))
        for name in _FUNCTIONS:
            orig = getattr(torch, name)
            saved.append((torch, name, orig))
            setattr(torch, name, _guard(name, orig, where))
        yield
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)
