"""How the ``qpass`` commands show the phases of :mod:`qpass.progress` (on stderr).

* On a terminal: a rich progress display (spinner, phase, bar, ``n/N``, elapsed, ETA); a finished
  top-level phase stays as one line with its time, a finished nested phase disappears.
* Otherwise (a log file, a pipe, CI): plain lines — one when a phase starts, one at most every
  ``interval_s`` seconds while it advances (``n/N``, elapsed, ETA) and one when it ends; a nested
  phase (e.g. the decode steps of one sampled batch) only once it has run for ``interval_s``::

      qpass: sampling 64 responses from the rollout graph: 1/4 batches, 31s, ETA 1m33s
      qpass: sampling 64 responses from the rollout graph: done 4/4 batches in 2m04s

A phase that does not advance for ``interval_s`` (one long forward, a single batch) gets a heartbeat
line from a daemon thread (:func:`heartbeat`), so a log never goes silent while a command works.

``$QPASS_PROGRESS`` overrides the choice: ``rich``, ``lines`` or ``off``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from qpass.progress import Phase, format_seconds, reporting

__all__ = ["LineReporter", "RichReporter", "command_progress", "heartbeat", "make_reporter", "quiet_third_party_bars"]

MODES = ("auto", "rich", "lines", "off")


def plural(unit: str, n: int) -> str:
    """``unit`` for ``n`` of them (English: batch -> batches, pass -> passes, file set -> file sets)."""
    if n == 1 or not unit:
        return unit
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _count(ph: Phase) -> str:
    if ph.total is None:
        return f"{ph.done} {plural(ph.unit, ph.done)}".rstrip() if ph.done else ""
    return f"{ph.done}/{ph.total} {plural(ph.unit, ph.total)}".rstrip()


class LineReporter:
    """Plain progress lines for a stream that is not a terminal (module docstring)."""

    def __init__(self, stream: Any = None, *, interval_s: float = 10.0, prefix: str = "qpass") -> None:
        self._stream = stream
        self.interval_s = float(interval_s)
        self.prefix = prefix
        self._last: dict[int, float] = {}
        self._shown: set[int] = set()
        self._open: list[Phase] = []  # running phases in start order (the heartbeat thread's view)
        self._lock = threading.RLock()
        self._last_write = time.perf_counter()

    @property
    def stream(self) -> Any:
        return self._stream if self._stream is not None else sys.stderr

    def _path(self, ph: Phase) -> str:
        from qpass.progress import active_phases

        outer = [p.name for p in active_phases() if p is not ph and p.depth < ph.depth]
        return " > ".join([*outer, ph.name])

    def _write(self, text: str) -> None:
        with self._lock:
            self._last_write = time.perf_counter()
            try:
                print(f"{self.prefix}: {text}", file=self.stream, flush=True)
            except (OSError, ValueError):  # a closed stream never fails the command
                pass

    def tick(self) -> None:
        """Heartbeat (:func:`heartbeat`): when nothing was written for ``interval_s`` while a phase runs,
        one line for the innermost running phase (a phase that does not advance — one long forward,
        a single batch — is otherwise silent until it ends)."""
        with self._lock:
            if not self._open or time.perf_counter() - self._last_write < self.interval_s:
                return
            ph = self._open[-1]
            self._shown.update(id(p) for p in self._open)
            self._last[id(ph)] = time.perf_counter()
            parts = [_count(ph), format_seconds(ph.elapsed_s)]
            if ph.eta_s is not None:
                parts.append(f"ETA {format_seconds(ph.eta_s)}")
            path = " > ".join(p.name for p in self._open)
            self._write(f"{path}: " + ", ".join(p for p in parts if p) + " (running)")

    def start(self, ph: Phase) -> None:
        with self._lock:
            self._open.append(ph)
        self._last[id(ph)] = time.perf_counter()
        if ph.depth == 0:  # a nested phase shows up only once it has run for interval_s
            total = f" ({ph.total} {plural(ph.unit, ph.total)})".replace(" )", ")") if ph.total else ""
            self._write(f"{self._path(ph)}{total} ...")
            self._shown.add(id(ph))

    def update(self, ph: Phase) -> None:
        now = time.perf_counter()
        if now - self._last.get(id(ph), 0.0) < self.interval_s:
            return
        self._last[id(ph)] = now
        self._shown.add(id(ph))
        eta = ph.eta_s
        parts = [_count(ph), format_seconds(ph.elapsed_s)]
        if eta is not None:
            parts.append(f"ETA {format_seconds(eta)}")
        if ph.note:
            parts.append(ph.note)
        self._write(f"{self._path(ph)}: " + ", ".join(p for p in parts if p))

    def end(self, ph: Phase, ok: bool) -> None:
        with self._lock:
            if ph in self._open:
                self._open.remove(ph)
        self._last.pop(id(ph), None)
        if id(ph) not in self._shown:
            return
        self._shown.discard(id(ph))
        count = _count(ph)
        note = f" ({ph.note})" if ph.note else ""
        what = "done" if ok else "stopped"
        self._write(f"{self._path(ph)}: {what}{' ' + count if count else ''} in {format_seconds(ph.elapsed_s)}{note}")


class RichReporter:
    """A rich live progress display on a terminal (module docstring)."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        class _ETA(TextColumn):
            def render(self, task: Any) -> Any:  # noqa: ANN401
                from rich.text import Text

                ph = task.fields.get("phase")
                eta = ph.eta_s if ph is not None else None
                return Text("" if eta is None or task.finished else f"ETA {format_seconds(eta)}", style="cyan")

        class _Count(MofNCompleteColumn):
            def render(self, task: Any) -> Any:  # noqa: ANN401
                from rich.text import Text

                ph = task.fields.get("phase")
                return Text(_count(ph) if ph is not None else "", style="green")

        self.progress = Progress(SpinnerColumn(finished_text="[green]✓[/]"), TextColumn("{task.description}"),
                                 BarColumn(bar_width=24), _Count(), TimeElapsedColumn(), _ETA(""),
                                 TextColumn("{task.fields[note]}", style="dim"), console=console, transient=False)
        self._tasks: dict[int, Any] = {}
        self._live = 0

    def start(self, ph: Phase) -> None:
        if self._live == 0:
            self.progress.start()
        self._live += 1
        self._tasks[id(ph)] = self.progress.add_task(("  " * ph.depth) + ph.name, total=ph.total, phase=ph, note=ph.note)

    def update(self, ph: Phase) -> None:
        tid = self._tasks.get(id(ph))
        if tid is not None:
            self.progress.update(tid, completed=ph.done, total=ph.total, note=ph.note)

    def end(self, ph: Phase, ok: bool) -> None:
        tid = self._tasks.pop(id(ph), None)
        if tid is not None:
            if ph.depth > 0:
                self.progress.remove_task(tid)
            else:
                total = ph.total if ph.total is not None else max(ph.done, 1)
                self.progress.update(tid, completed=total if ok else ph.done, total=total, note=ph.note if ok else "stopped")
        self._live -= 1
        if self._live == 0:
            self.progress.stop()
            for t in list(self.progress.task_ids):
                self.progress.remove_task(t)


def make_reporter(console: Any = None, *, mode: str | None = None) -> Any:
    """The reporter for this process: ``mode`` (default ``$QPASS_PROGRESS``, else ``auto``: rich on a
    terminal stderr, plain lines otherwise; ``off``: None)."""
    mode = (mode or os.environ.get("QPASS_PROGRESS") or "auto").lower()
    if mode not in MODES:
        mode = "auto"
    if mode == "off":
        return None
    if mode == "auto":
        mode = "rich" if sys.stderr.isatty() else "lines"
    if mode == "rich":
        if console is None:
            from qpass.apps.console import console as make_console

            console = make_console()
        return RichReporter(console)
    return LineReporter()


def quiet_third_party_bars() -> None:
    """Turn off transformers' own tqdm bars (the GGUF de-quantization bar of the model load): in a log
    they are one long line of carriage returns, on a terminal they tear the rich display; the load is
    a phase of its own."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_progress_bar()


@contextmanager
def command_progress(console: Any = None, *, enabled: bool = True) -> Iterator[Any]:
    """Show the phases of the block (:func:`make_reporter`); ``enabled`` False: silence."""
    rep = make_reporter(console) if enabled else None
    if rep is not None:
        quiet_third_party_bars()
    with reporting(rep), heartbeat(rep):
        yield rep


@contextmanager
def heartbeat(rep: Any) -> Iterator[None]:
    """A daemon thread calling ``rep.tick()`` every ``interval_s / 2`` while the block runs (plain-line
    reporters only; the rich display animates by itself)."""
    if not isinstance(rep, LineReporter):
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(rep.interval_s / 2):
            rep.tick()

    t = threading.Thread(target=beat, name="qpass-progress-heartbeat", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=1.0)
