"""Console output of ``qpass apply`` / ``qpass check`` (rich, on stderr): spinners, pass lines, the parity table.

Only presentation lives here; the numbers come from the report dict (:mod:`qpass.apps.report`).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any


def console() -> Any:
    """A rich Console on stderr (never wrapped at 80 columns when stderr is not a terminal)."""
    from rich.console import Console

    return Console(stderr=True, width=None if sys.stderr.isatty() else max(160, shutil.get_terminal_size().columns))


def print_passes(con: Any, history: list[Any]) -> None:
    """One line per pass run: side, name, matches, skipped, seconds."""
    for h in history:
        con.print(f"  {h.side:8s} {h.name:24s} matches={h.matches:4d} skipped={len(h.skipped):3d} {h.elapsed_s:6.2f}s")


def _verdict(v: bool | None) -> str:
    return "n/a" if v is None else ("[green]pass[/]" if v else "[red]FAIL[/]")


def print_summary(con: Any, report: dict[str, Any], out: Path) -> None:
    """The parity table of a finished ``qpass apply``, its first problems and where the report went."""
    from rich.table import Table

    p = report["parity"]
    t = Table(title=f"qpass parity: {report['recipe']['name']} on {report['model']['name']}")
    t.add_column("check")
    t.add_column("result")
    t.add_row("structural", _verdict(p["structural_ok"]))
    t.add_row("weights bit-exact", _verdict(p["weights_bitexact"])
              + (f" ({len(p['mismatched_groups'])} groups differ)" if p["mismatched_groups"] else ""))
    gated = {c["check"]: c["ok"] for c in p.get("checks", [])}.get("logprob_gap")
    for key, label in (("logprob_gap", "log-prob gap (recipe)"), ("floor_logprob_gap", "log-prob gap (bf16 floor)")):
        g = p.get(key)
        if g:
            verdict = "" if key != "logprob_gap" else (" (not gated)" if gated is None else f" {_verdict(gated)}")
            t.add_row(label, f"mean|d| {_num(g['mean_abs'])}  max|d| {_num(g['max_abs'], 3)}  K1 {_num(g['k1'])}  "
                             f"K3 {_num(g['k3'])}  ({g['tokens']} tokens){verdict}")
    con.print(t)
    for prob in p["problems"][:10]:
        con.print(f"[red]- {prob}[/]")
    print_files(con, out)
    v = report.get("verdict") or {}
    if v.get("line"):
        con.print(("[bold green]" if report["ok"] else "[bold red]") + _escape(v["line"]) + "[/]", soft_wrap=True, highlight=False)


def print_files(con: Any, out: Path) -> None:
    """Every file of the output directory ``out``: path, size, what it is (:data:`qpass.apps.report.OUTPUT_FILES`)."""
    from qpass.apps.report import output_files

    rows = output_files(out)
    con.print(f"wrote {out}/ ({len(rows)} files):")
    width = max((len(r[0]) for r in rows), default=0)
    for rel, size, what in rows:
        con.print(f"  {_escape(rel):{width}s}  {_size(size):>8s}  {_escape(what)}", soft_wrap=True, highlight=False)


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))


def _num(v: Any, digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def print_check_problems(con: Any, label: str, problems: list[str] | tuple[str, ...], limit: int = 20) -> None:
    """Red lines ``label: problem`` (at most ``limit``, then a count)."""
    for f in list(problems)[:limit]:
        con.print(f"[red]{label}: {f}[/]")
    if len(problems) > limit:
        con.print(f"[red]{label}: ... {len(problems) - limit} more[/]")
