"""Progress of long phases: a phase name, ``n of N`` units done, elapsed time and an ETA.

Library code marks its long loops with :func:`track` (an iterable) or :func:`phase` (a context
manager with :meth:`Phase.advance`); nothing is shown unless a reporter is installed with
:func:`reporting`. The ``qpass`` commands install one (:mod:`qpass.apps.progress`: a rich progress
display on a terminal, plain lines otherwise), tests and notebooks get silence by default.

A leaf module (no qpass imports), so the core, the backends and the apps can all report through it.

Example::

    with phase("bit-level weight parity", total=len(groups), unit="group") as ph:
        for g in groups:
            ...
            ph.advance()

    for batch in track(batches, "sampling", unit="batch"):
        ...
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

__all__ = ["Phase", "Reporter", "active_phases", "format_seconds", "phase", "reporting", "track"]

T = TypeVar("T")


@dataclasses.dataclass
class Phase:
    """One running phase.

    Attributes:
        name: what runs (``"sampling 64 responses from the rollout graph"``).
        total: units in all (None: unknown; the display shows elapsed time only).
        unit: the unit's name for display (``"batch"``, ``"group"``, ``"step"``).
        done: units finished so far.
        note: a short status shown next to the count (e.g. ``"reward 0.41"``).
        depth: 0 for a top-level phase, 1 for one started inside it, ...
        t0: ``time.perf_counter()`` at the start.
    """

    name: str
    total: int | None = None
    unit: str = ""
    done: int = 0
    note: str = ""
    depth: int = 0
    t0: float = dataclasses.field(default_factory=lambda: time.perf_counter())
    _reporter: "Reporter | None" = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def elapsed_s(self) -> float:
        """Seconds since the phase started."""
        return time.perf_counter() - self.t0

    @property
    def eta_s(self) -> float | None:
        """Estimated seconds left (elapsed / done x remaining); None before the first unit or without a total."""
        if not self.total or self.done <= 0 or self.done >= self.total:
            return None if not self.total or self.done < self.total else 0.0
        return self.elapsed_s / self.done * (self.total - self.done)

    def advance(self, n: int = 1, note: str | None = None) -> None:
        """``n`` more units finished (and an optional new ``note``)."""
        self.done += int(n)
        if note is not None:
            self.note = note
        if self._reporter is not None:
            self._reporter.update(self)

    def set_total(self, total: int | None) -> None:
        """Change the total (e.g. once it is known)."""
        self.total = total
        if self._reporter is not None:
            self._reporter.update(self)


class Reporter(Protocol):
    """Who shows phases: called when a phase starts, advances and ends (``ok`` False: it raised)."""

    def start(self, ph: Phase) -> None: ...

    def update(self, ph: Phase) -> None: ...

    def end(self, ph: Phase, ok: bool) -> None: ...


_REPORTER: contextvars.ContextVar["Reporter | None"] = contextvars.ContextVar("qpass_progress_reporter", default=None)
_STACK: contextvars.ContextVar[tuple[Phase, ...]] = contextvars.ContextVar("qpass_progress_stack", default=())


@contextlib.contextmanager
def reporting(reporter: Reporter | None) -> Iterator[Reporter | None]:
    """Install ``reporter`` for the phases started inside the block (None: silence)."""
    tok = _REPORTER.set(reporter)
    try:
        yield reporter
    finally:
        _REPORTER.reset(tok)


def active_phases() -> tuple[Phase, ...]:
    """The phases running now, outermost first."""
    return _STACK.get()


@contextlib.contextmanager
def phase(name: str, total: int | None = None, *, unit: str = "") -> Iterator[Phase]:
    """Run the block as a phase named ``name`` of ``total`` units (advance it with :meth:`Phase.advance`)."""
    rep = _REPORTER.get()
    stack = _STACK.get()
    ph = Phase(name, None if total is None else int(total), unit, depth=len(stack), _reporter=rep)
    tok = _STACK.set(stack + (ph,))
    if rep is not None:
        rep.start(ph)
    ok = False
    try:
        yield ph
        ok = True
    finally:
        try:
            _STACK.reset(tok)
        except ValueError:  # a generator (track) closed from another context: drop this phase by hand
            _STACK.set(tuple(p for p in _STACK.get() if p is not ph))
        if rep is not None:
            rep.end(ph, ok)


def track(items: Iterable[T], name: str, total: int | None = None, *, unit: str = "") -> Iterator[T]:
    """Iterate ``items`` as a phase: one unit per item (``total`` defaults to ``len(items)``)."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with phase(name, total, unit=unit) as ph:
        for item in items:
            yield item
            ph.advance()


def format_seconds(s: float | None) -> str:
    """``"42s"``, ``"3m05s"``, ``"1h02m"`` (``"?"`` for None)."""
    if s is None:
        return "?"
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
