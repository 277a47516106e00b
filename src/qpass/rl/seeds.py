"""Deterministic seeds of a GRPO run: every recipe derives the same seed from the same parts."""

from __future__ import annotations

__all__ = ["derive_seed"]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (FNV-1a over each part's low 64 bits; same parts -> same seed).

    ``derive_seed(cfg.seed, step, chunk)`` seeds a sampling chunk, ``(cfg.seed, step, 3)`` the update's
    epoch order, ``(cfg.seed, 7, step)`` the held-out eval, ``(cfg.seed, 1)`` the problem stream.
    """
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h
