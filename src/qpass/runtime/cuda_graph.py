"""The rollout's decode step (one token per row, static KV cache) replayed as a CUDA graph.

The step graph (:mod:`qpass.graph.capture`) has static shapes in decode: ``input_ids [B, 1]``,
``position_ids [B, 1]``, ``cache_position [1]``, ``attention_mask [B, L]``; its KV cache is a set of
buffers written in place at ``cache_position`` and its quantized weight constants are rewritten in
place by :func:`qpass.runtime.sync.sync_weights` (``copy_``), so one capture stays valid across
decode steps, ``generate`` calls and weight updates. A 135M model's decode step is launch-bound
(hundreds of small kernels per token); a replay launches them as one graph.

:class:`DecodeGraph` captures lazily on the first decode call: that call runs eagerly (its output
is used; it also warms up cuBLAS/Triton on a side stream, as ``torch.cuda.graphs`` requires), then
the same call is captured (capture records kernels, it does not run them, so the KV cache is not
written twice), and every later call copies its inputs into the static input tensors and replays.
Every op of every recipe's step graph is device-side once the host-syncing value checks are off
(:func:`qpass.sync_checks.sync_checks_enabled`: off under capture; the eager warm-up call keeps them),
for the reference and the Triton kernels alike; ``tests/test_grpo_long.py`` proves it on CPU with
:func:`qpass.runtime.host_sync.forbid_host_sync` for every built-in recipe. If capture fails anyway (an
allocator limit, a new op that synchronises), mode ``"auto"`` logs the reason and stays eager for
the engine's lifetime, mode ``"on"`` raises.

On a CPU device the eager path is kept (``status`` says why).

Source: ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` (PyTorch "CUDA Graphs" notes: static
inputs, warm-up on a side stream, in-place input copies before ``replay``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch

from qpass.errors import QpassError
from qpass.sync_checks import no_sync_checks

log = logging.getLogger(__name__)

__all__ = ["CUDA_GRAPH_MODES", "DecodeGraph", "TorchCudaGraphs"]

#: ``cuda_graphs`` modes of the rollout engine.
CUDA_GRAPH_MODES = ("auto", "on", "off")


class TorchCudaGraphs:
    """The capture primitives :class:`DecodeGraph` uses (``torch.cuda``); a test substitutes its own."""

    @staticmethod
    def warmup(step: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
        """``step(*args)`` eagerly on a side stream (cuBLAS / Triton initialisation outside capture)."""
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            out = step(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        return out

    @staticmethod
    def capture(step: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...],
                device: torch.device) -> tuple[Callable[[], None], torch.Tensor]:
        """``(replay, static_output)`` of ``step(*args)`` recorded as one CUDA graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*args)
        return graph.replay, out

    @staticmethod
    def synchronize(device: torch.device) -> None:
        torch.cuda.synchronize(device)


class DecodeGraph:
    """A decode-step callable ``(input_ids, position_ids, cache_position, attention_mask) -> logits``.

    Args:
        step: the step graph module (called eagerly, and once under capture).
        mode: ``"auto"`` | ``"on"`` | ``"off"`` (see module docstring).
        device: the device the step graph lives on.
        backend: the capture primitives (default :class:`TorchCudaGraphs`).
    Attributes:
        status: ``"eager (off)"``, ``"eager (cpu)"``, ``"pending"`` (CUDA, not captured yet),
            ``"captured"``, or ``"eager (capture failed: ...)"``.
        replays: decode calls served by a replay.
    Raises:
        QpassError: unknown ``mode``; ``mode == "on"`` on a non-CUDA device.
    """

    def __init__(self, step: Callable[..., torch.Tensor], *, mode: Literal["auto", "on", "off"], device: torch.device,
                 backend: object | None = None) -> None:
        if mode not in CUDA_GRAPH_MODES:
            raise QpassError(f"cuda_graphs must be one of {list(CUDA_GRAPH_MODES)}, got {mode!r}")
        self.step = step
        self.mode = mode
        self.device = torch.device(device)
        self.backend = backend or TorchCudaGraphs()
        self.replays = 0
        self._replay: Callable[[], None] | None = None
        self._static: tuple[torch.Tensor, ...] | None = None
        self._out: torch.Tensor | None = None
        if mode == "off":
            self.status = "eager (off)"
        elif self.device.type != "cuda":
            if mode == "on":
                raise QpassError(f"cuda_graphs='on' needs a CUDA device; the rollout graph is on {self.device}")
            self.status = f"eager ({self.device.type})"
        else:
            self.status = "pending"

    @property
    def active(self) -> bool:
        """Whether decode calls go (or will go) through a CUDA graph."""
        return self.status in ("pending", "captured")

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                 attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of one decode step (when captured: the graph's static output tensor,
        overwritten by the next call: read it before).

        Raises:
            QpassError: input shapes differ from the captured ones; capture failed under ``"on"``.
        """
        args = (input_ids, position_ids, cache_position, attention_mask)
        if self.status == "captured":
            assert self._static is not None and self._out is not None and self._replay is not None
            for dst, src in zip(self._static, args):
                if dst.shape != src.shape:
                    raise QpassError(f"decode graph captured for input shapes {[tuple(t.shape) for t in self._static]}, "
                                     f"got {[tuple(t.shape) for t in args]}")
                dst.copy_(src)
            self._replay()
            self.replays += 1
            return self._out
        if self.status != "pending":
            return self.step(*args)
        # first call on CUDA: eager warm-up (its result is this call's), then capture of the same call
        static = tuple(a.clone() for a in args)
        out = self.backend.warmup(self.step, static, self.device)
        try:
            with no_sync_checks():  # value checks read the device; capture already turns them off on CUDA
                self._replay, self._out = self.backend.capture(self.step, static, self.device)
        except Exception as exc:  # noqa: BLE001 - any capture failure: the mode decides
            if self.mode == "on":
                raise QpassError(f"CUDA graph capture of the decode step failed: {type(exc).__name__}: {exc}") from exc
            self.status = f"eager (capture failed: {type(exc).__name__}: {str(exc)[:200]})"
            log.warning("decode step stays eager: %s", self.status)
            self.backend.synchronize(self.device)
            return out
        self._static = static
        self.status = "captured"
        return out
