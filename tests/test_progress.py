"""Progress of long phases (``qpass.progress`` + the console reporters of ``qpass.apps.progress``).

Library code reports phases whether or not anyone listens; the commands install a reporter: rich on
a terminal, plain lines otherwise (a log, CI). Timings here use a fake clock, never wall time.
"""

from __future__ import annotations

import io

import pytest

from qpass import progress
from qpass.apps import progress as view
from qpass.progress import Phase, format_seconds, phase, reporting, track


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr("time.perf_counter", c)  # what qpass.progress and qpass.apps.progress read
    return c


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, int | None, int]] = []

    def start(self, ph: Phase) -> None:
        self.events.append(("start", ph.name, ph.done, ph.total, ph.depth))

    def update(self, ph: Phase) -> None:
        self.events.append(("update", ph.name, ph.done, ph.total, ph.depth))

    def end(self, ph: Phase, ok: bool) -> None:
        self.events.append(("end" if ok else "fail", ph.name, ph.done, ph.total, ph.depth))


def test_phases_are_silent_without_a_reporter_and_reported_with_one():
    assert list(track([1, 2], "silent")) == [1, 2]  # no reporter: just the items
    rec = Recorder()
    with reporting(rec):
        with phase("outer", total=2, unit="step") as ph:
            for _ in track(range(3), "inner"):
                pass
            ph.advance()
            ph.advance()
    assert rec.events == [
        ("start", "outer", 0, 2, 0),
        ("start", "inner", 0, 3, 1), ("update", "inner", 1, 3, 1), ("update", "inner", 2, 3, 1), ("update", "inner", 3, 3, 1),
        ("end", "inner", 3, 3, 1),
        ("update", "outer", 1, 2, 0), ("update", "outer", 2, 2, 0), ("end", "outer", 2, 2, 0),
    ]
    assert progress.active_phases() == ()


def test_a_phase_that_raises_ends_as_failed_and_unwinds():
    rec = Recorder()
    with reporting(rec), pytest.raises(ZeroDivisionError):
        with phase("boom", total=4):
            1 / 0  # noqa: B018
    assert rec.events[-1] == ("fail", "boom", 0, 4, 0)
    assert progress.active_phases() == ()


def test_eta_is_elapsed_per_unit_times_units_left(clock):
    with phase("x", total=4) as ph:
        assert ph.eta_s is None  # nothing done yet
        clock.t += 30.0
        ph.advance()
        assert ph.eta_s == pytest.approx(90.0)
        ph.advance(3)
        assert ph.eta_s == 0.0
    with phase("unknown total") as ph:
        ph.advance()
        assert ph.eta_s is None
    assert [format_seconds(s) for s in (None, 4.4, 65, 3725)] == ["?", "4s", "1m05s", "1h02m"]


def test_line_reporter_prints_start_throttled_progress_and_end(clock):
    buf = io.StringIO()
    with reporting(view.LineReporter(buf, interval_s=10.0)):
        with phase("sampling 64 responses", total=4, unit="batch") as ph:
            clock.t += 31.0
            ph.advance(note="reward 0.41")  # 31 s after the start line: printed
            clock.t += 5.0
            ph.advance()  # 5 s after the last line: throttled
            clock.t += 60.0
            ph.advance(2)
    assert buf.getvalue().splitlines() == [
        "qpass: sampling 64 responses (4 batches) ...",
        "qpass: sampling 64 responses: 1/4 batches, 31s, ETA 1m33s, reward 0.41",
        "qpass: sampling 64 responses: 4/4 batches, 1m36s, ETA 0s, reward 0.41",
        "qpass: sampling 64 responses: done 4/4 batches in 1m36s (reward 0.41)",
    ]


def test_line_reporter_shows_a_nested_phase_only_once_it_is_long(clock):
    buf = io.StringIO()
    with reporting(view.LineReporter(buf, interval_s=10.0)):
        with phase("gap", total=2, unit="batch") as ph:
            with phase("decode", total=24, unit="token") as d:  # short: never shown
                clock.t += 2.0
                d.advance(24)
            ph.advance()
            with phase("decode", total=24, unit="token") as d:  # long: shown with its parent's name
                clock.t += 12.0
                d.advance(12)
                clock.t += 12.0
                d.advance(12)
            ph.advance()
    lines = buf.getvalue().splitlines()
    assert lines == [
        "qpass: gap (2 batches) ...",
        "qpass: gap > decode: 12/24 tokens, 12s, ETA 12s",
        "qpass: gap > decode: 24/24 tokens, 24s, ETA 0s",
        "qpass: gap > decode: done 24/24 tokens in 24s",
        "qpass: gap: 2/2 batches, 26s, ETA 0s",
        "qpass: gap: done 2/2 batches in 26s",
    ]


def test_make_reporter_picks_lines_off_a_terminal_and_honours_qpass_progress(monkeypatch):
    monkeypatch.delenv("QPASS_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a tty
    assert isinstance(view.make_reporter(), view.LineReporter)
    monkeypatch.setenv("QPASS_PROGRESS", "off")
    assert view.make_reporter() is None
    monkeypatch.setenv("QPASS_PROGRESS", "rich")
    assert isinstance(view.make_reporter(), view.RichReporter)


def test_rich_reporter_renders_count_elapsed_and_eta():
    from rich.console import Console

    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=120)
    rep = view.RichReporter(con)
    with reporting(rep):
        with phase("bit-level weight parity", total=120, unit="group") as ph:
            ph.advance(30)
            con.print(rep.progress)  # one frame of the live display
    text = out.getvalue()
    assert "bit-level weight parity" in text and "30/120 group" in text and "ETA" in text


def test_line_reporter_heartbeat_names_a_phase_that_does_not_advance(clock):
    """A fresh user saw 34 s without a line in the BF16-floor phase and 14 s while the learner scored:
    a phase that never advances now gets a line once nothing was written for interval_s."""
    buf = io.StringIO()
    rep = view.LineReporter(buf, interval_s=10.0)
    with reporting(rep):
        with phase("BF16 floor", total=1, unit="batch"):
            with phase("score with the learner"):
                clock.t += 5.0
                rep.tick()  # 5 s after the start line: nothing
                clock.t += 9.0
                rep.tick()  # 14 s without a line: one for the innermost phase
                clock.t += 3.0
                rep.tick()  # 3 s after that line: nothing
    assert buf.getvalue().splitlines() == [
        "qpass: BF16 floor (1 batch) ...",
        "qpass: BF16 floor > score with the learner: 14s (running)",
        "qpass: BF16 floor > score with the learner: done in 17s",
        "qpass: BF16 floor: done 0/1 batch in 17s",
    ]
    rep.tick()  # no phase running: nothing
    assert len(buf.getvalue().splitlines()) == 4


def test_heartbeat_thread_ticks_line_reporters_only():
    import threading

    class Ticks(view.LineReporter):
        def __init__(self) -> None:
            super().__init__(io.StringIO(), interval_s=0.01)
            self.n, self.seen = 0, threading.Event()

        def tick(self) -> None:
            self.n += 1
            if self.n >= 3:
                self.seen.set()

    rep = Ticks()
    with view.heartbeat(rep):
        assert rep.seen.wait(5.0)
    n = rep.n
    assert not any(t.name == "qpass-progress-heartbeat" and t.is_alive() for t in threading.enumerate())
    assert rep.n == n  # stopped with the block
    with view.heartbeat(object()):  # not a line reporter: no thread
        assert not any(t.name == "qpass-progress-heartbeat" for t in threading.enumerate())
