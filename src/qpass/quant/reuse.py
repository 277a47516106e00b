"""Reuse of weight-quantization results while the weights cannot change (issue 13).

Inside :func:`reuse_weight_quantization` the weight quantizers memoize their results, so a pass
that quantizes the same weight version several times computes it once:

* the learner's ``qpass::nvfp4_qdq_linear`` operand ``(B_W, S_dec_W)`` (forward and backward:
  :func:`qpass.quant.qdq.learner_weight_operand`), ``qpass::nvfp4_qdq`` and ``qpass::group_amax``
  (every micro-batch of the no-grad proximal pass, and every micro-batch of one
  gradient-accumulation minibatch, run at the same weights);
* :func:`qpass.quant.weights.quantize_site_weights` (weight sync) and
  :func:`qpass.apps.grpo.weights.verify_sync` (the learner-side fingerprint), which quantize the
  same master weights with the same group amax right after each other.

Outside the context nothing is stored and every call computes (the default; plain library use and
every test that does not enter the context see the uncached reference path).

**Key.** A weight is identified by ``(device, dtype, shape, stride, storage offset, storage
address, tensor version)`` plus the exact float32 bits of the amax it is quantized with and the
spec/arithmetic; the entry keeps a reference to the weight, so its storage (and address) cannot be
reused while the entry lives. ``torch.Tensor._version`` is shared by a parameter, its ``detach()``
and its views, and every in-place write through any of them bumps it (``p.copy_``, AdamW's
``foreach`` updates, ``load_state_dict``): an optimizer step inside the context invalidates the
entry (the next call misses and recomputes). Not seen by the key, so never done inside the
context: writes through ``p.data`` (a tensor with its *own* version counter) or through raw
storage. The results are bit-identical to the uncached call because they *are* the uncached call's
results for the same input bits.

**What is cached is shared.** Cached quantized tensors (``NVFP4Tensor`` ...) are returned as the
same object to every caller and must be treated as read-only; the custom ops return a fresh clone
(their outputs get autograd history).

Tensors that are not plain ``torch.Tensor`` / ``Parameter`` (fake, functional, meta, inference
tensors) are never cached.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")

__all__ = ["ReuseStore", "amax_bits", "memo", "no_reuse", "reuse_active", "reuse_weight_quantization", "reuse_stats",
           "weight_key"]


class ReuseStore:
    """The entries of one :func:`reuse_weight_quantization` scope.

    At most one entry per ``(kind, weights without their versions)``: storing a newer version (or
    another amax / spec for the same weights) replaces the older entry, so a store that lives
    across optimizer steps holds one result per weight and kind, never a history.

    Args:
        enabled: False: activating this store caches nothing (every call computes; for A/B
            measurements and equality tests).
    Attributes:
        hits, misses: lookup counters (tests, profiling).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.entries: dict[Hashable, tuple[tuple[torch.Tensor, ...], Any]] = {}
        self.latest: dict[Hashable, Hashable] = {}
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        """Drop every entry (and the references to the weights they keep)."""
        self.entries.clear()
        self.latest.clear()


_local = threading.local()


def _store() -> ReuseStore | None:
    return getattr(_local, "store", None)


def reuse_active() -> bool:
    """True inside :func:`reuse_weight_quantization` (on this thread)."""
    return _store() is not None


@contextlib.contextmanager
def reuse_weight_quantization(store: ReuseStore | None = None) -> Iterator[ReuseStore]:
    """Memoize weight quantization for the duration of the ``with`` block (see module docstring).

    Args:
        store: a store to activate (its entries are kept on exit, so a caller can span several
            blocks with one store and :meth:`ReuseStore.clear` it itself); None: a fresh store whose
            entries are dropped on exit. Nested blocks keep the outer block's store.
    Yields:
        the active store.
    """
    outer = _store()
    if outer is not None:
        yield outer
        return
    st = ReuseStore() if store is None else store
    if not st.enabled:
        yield st
        return
    _local.store = st
    try:
        yield st
    finally:
        _local.store = None
        if store is None:
            st.clear()


@contextlib.contextmanager
def no_reuse() -> Iterator[None]:
    """Compute every quantization inside the block, even within :func:`reuse_weight_quantization`
    (for checks that must not read results another stage computed, e.g. the full bit-exact check)."""
    outer = _store()
    _local.store = None
    try:
        yield
    finally:
        _local.store = outer


def reuse_stats() -> tuple[int, int] | None:
    """``(hits, misses)`` of the active store, or None outside the context."""
    st = _store()
    return None if st is None else (st.hits, st.misses)


def weight_key(w: torch.Tensor) -> tuple | None:
    """The identity-and-version key of ``w`` (module docstring), or None when ``w`` cannot be cached."""
    if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.is_inference() or w.device.type == "meta":
        return None
    return (w.device, w.dtype, tuple(w.shape), w.stride(), w.storage_offset(), w.untyped_storage().data_ptr(),
            w._version)


def amax_bits(amax: torch.Tensor | None) -> tuple[int, ...] | None:
    """The exact float32 bits of ``amax`` (a host read of a few values), None for None."""
    if amax is None:
        return None
    return tuple(amax.detach().float().reshape(-1).view(torch.int32).tolist())


def memo(kind: Hashable, tensors: Sequence[torch.Tensor], extra: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` once per ``(kind, weight_key(t) for t in tensors, extra)`` inside the context.

    Args:
        kind: what is computed (e.g. ``"nvfp4_qdq"``).
        tensors: the weights the result is a function of (keyed by identity and version).
        extra: every other input the result depends on, hashable (amax bits, spec, dtype ...).
        compute: the uncached computation.
    Returns:
        ``compute()``'s result, or the stored result of an earlier call with the same key.
        Outside the context (or for uncacheable tensors) always ``compute()``.
    """
    st = _store()
    if st is None:
        return compute()
    keys = []
    for t in tensors:
        k = weight_key(t)
        if k is None:
            return compute()
        keys.append(k)
    key = (kind, tuple(keys), extra)
    hit = st.entries.get(key)
    if hit is not None:
        st.hits += 1
        return hit[1]
    st.misses += 1
    value = compute()
    slot = (kind, tuple(k[:-1] for k in keys))  # the same weights at any version
    old = st.latest.get(slot)
    if old is not None:
        st.entries.pop(old, None)
    st.entries[key] = (tuple(tensors), value)
    st.latest[slot] = key
    return value
