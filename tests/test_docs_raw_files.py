"""Every raw file the docs cite by its full path (`docs/results/...` in backticks) exists in the
repository, unless the citing line says the file was not kept ("not kept" / "never committed" / "dropped in issue 33").

Braces expand (`dir/{a.json,b.md}`), `<recipe>` and `*` match any name. Paths relative to a
directory named earlier in the text (`runs/<recipe>/metrics.jsonl`) are not checked here.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_KEPT = ("not kept", "never committed", "dropped in issue 33")


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in _expand(path[: m.start()] + alt + path[m.end():])]


def missing_raw_files(docs: list[Path], root: Path = ROOT) -> tuple[int, list[str]]:
    """``(number of cited paths, ["file:line: path"] for each missing one not marked as not kept)``."""
    n, bad = 0, []
    for doc in docs:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for span in re.findall(r"`([^`]*docs/results/[^`]*)`", line):
                for tok in re.findall(r"docs/results/[^\s`]*", span):
                    for p in _expand(tok.rstrip(".:);,")):
                        n += 1
                        pattern = str(root / re.sub(r"<[^>]*>", "*", p))
                        if not glob.glob(pattern) and not any(m in line for m in NOT_KEPT):
                            bad.append(f"{doc.relative_to(root)}:{i}: {p}")
    return n, bad


def test_every_cited_raw_file_exists():
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "scripts" / "README.md",
            *sorted((ROOT / "docs").rglob("*.md"))]
    n, bad = missing_raw_files(docs)
    assert n > 50  # the docs do cite raw files by full path
    assert bad == [], "\n".join(bad)


def test_checker_finds_a_missing_file_and_honours_the_not_kept_marker(tmp_path):
    (tmp_path / "docs" / "results" / "d").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "d" / "a.json").write_text("{}")
    (tmp_path / "docs" / "results" / "d" / "r1").mkdir()
    (tmp_path / "docs" / "results" / "d" / "r1" / "m.jsonl").write_text("")
    doc = tmp_path / "R.md"
    doc.write_text(
        "ok `docs/results/d/a.json` and `docs/results/d/<run>/m.jsonl`.\n"
        "braces `docs/results/d/{a.json,b.md}`.\n"
        "lost `docs/results/d/c.log` (not kept: ignored).\n"
        "gone `docs/results/e/x.txt`).\n"
    )
    n, bad = missing_raw_files([doc], tmp_path)
    assert n == 6
    assert bad == ["R.md:2: docs/results/d/b.md", "R.md:4: docs/results/e/x.txt"]
