"""docs/results/INDEX.json lists every raw file under docs/results/ with its sha256, and the topic pages agree.

Raw file = any file under ``docs/results/`` except the topic pages ``docs/results/*.md`` and ``INDEX.json``
itself. Each topic page ends with a raw-file table between ``<!-- raw-files:begin -->`` and
``<!-- raw-files:end -->``; the table is generated from INDEX.json (``python tests/test_results_index.py
--write-tables``) and this test checks that it still is.

Run as a script:
    python tests/test_results_index.py --write-tables    # rewrite every page's table from INDEX.json
    python tests/test_results_index.py --refresh          # recompute sha256/bytes of listed files, then the tables
Exit 2 on a bad argument.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "INDEX.json"
BEGIN, END = "<!-- raw-files:begin -->", "<!-- raw-files:end -->"
FIELDS = ("path", "sha256", "bytes", "commit", "machine", "command", "topic")


def load_index(index: Path = INDEX) -> list[dict]:
    """Rows of INDEX.json (``{"files": [...]}``), each with at least :data:`FIELDS`."""
    return json.loads(index.read_text())["files"]


def raw_files(results: Path = RESULTS) -> list[str]:
    """Repository-relative paths of every raw file under ``results`` (topic pages and INDEX.json excepted)."""
    root = results.parents[1]
    out = []
    for p in sorted(results.rglob("*")):
        if not p.is_file() or p == results / "INDEX.json" or (p.parent == results and p.suffix == ".md"):
            continue
        out.append(p.relative_to(root).as_posix())
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def index_problems(rows: list[dict], results: Path = RESULTS) -> list[str]:
    """Every disagreement between INDEX.json rows and the files on disk, one line each (empty = consistent)."""
    root = results.parents[1]
    bad = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        missing = [f for f in FIELDS if f not in row or row[f] in (None, "")]
        if missing:
            bad.append(f"row {i} ({row.get('path')}): missing {missing}")
            continue
        seen[row["path"]] = seen.get(row["path"], 0) + 1
        p = root / row["path"]
        if not p.is_file():
            bad.append(f"listed but missing: {row['path']}")
            continue
        if p.stat().st_size != row["bytes"]:
            bad.append(f"bytes differ: {row['path']} listed {row['bytes']}, file {p.stat().st_size}")
        if sha256(p) != row["sha256"]:
            bad.append(f"sha256 differs: {row['path']}")
        if not (results / f"{row['topic']}.md").is_file():
            bad.append(f"topic page missing: {row['topic']}.md (for {row['path']})")
    bad += [f"listed {n} times: {p}" for p, n in seen.items() if n > 1]
    bad += [f"not listed in INDEX.json: {p}" for p in raw_files(results) if p not in seen]
    return bad


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def render_table(rows: list[dict], topic: str) -> str:
    """The raw-file table of one topic page (rows of that topic, INDEX.json order)."""
    lines = [BEGIN, "", "| path | commit | machine | command | sha256 |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["topic"] == topic:
            cmd = r["command"] + (f" ({r['note']})" if r.get("note") else "")
            lines.append(f"| `{r['path']}` | `{r['commit']}` | {r['machine']} | {_cell(cmd)} | `{r['sha256']}` |")
    return "\n".join(lines + ["", END])


def page_table(page: Path) -> str | None:
    text = page.read_text()
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN): text.index(END) + len(END)]


def write_tables(rows: list[dict], results: Path = RESULTS) -> None:
    for topic in sorted({r["topic"] for r in rows}):
        page = results / f"{topic}.md"
        text = page.read_text()
        old = page_table(page)
        new = render_table(rows, topic)
        page.write_text(text.replace(old, new) if old else text.rstrip("\n") + "\n\n" + new + "\n")


def test_every_raw_file_is_listed_with_its_sha256_and_every_listed_file_exists():
    rows = load_index()
    assert len(rows) > 300  # the index covers the tree, not a sample
    assert index_problems(rows) == []


def test_every_topic_page_table_agrees_with_the_index():
    rows = load_index()
    topics = {r["topic"] for r in rows}
    pages = {p.stem for p in RESULTS.glob("*.md")}
    assert topics <= pages
    for topic in sorted(topics):
        page = RESULTS / f"{topic}.md"
        assert page_table(page) == render_table(rows, topic), f"{page.name}: run python tests/test_results_index.py --write-tables"
        head = page.read_text().split("\n## ")[1]
        assert head.startswith("Claims"), f"{page.name}: the first section must be the claims summary"


def test_checker_names_an_unlisted_file_a_wrong_hash_and_a_missing_file(tmp_path):
    res = tmp_path / "docs" / "results"
    (res / "d").mkdir(parents=True)
    (res / "t.md").write_text("# t\n\n## Claims\n")
    (res / "d" / "a.json").write_text("{}")
    (res / "d" / "b.txt").write_text("b")
    (res / "d" / "notes.md").write_text("raw markdown counts as a raw file")
    rows = [
        dict(path="docs/results/d/a.json", sha256=hashlib.sha256(b"{}").hexdigest(), bytes=2, commit="abc1234",
             machine="CPU", command="`x`", topic="t"),
        dict(path="docs/results/d/b.txt", sha256="0" * 64, bytes=1, commit="abc1234", machine="CPU", command="`x`", topic="t"),
        dict(path="docs/results/d/gone.json", sha256="0" * 64, bytes=1, commit="abc1234", machine="CPU", command="`x`", topic="t"),
    ]
    assert index_problems(rows, res) == [
        "sha256 differs: docs/results/d/b.txt",
        "listed but missing: docs/results/d/gone.json",
        "not listed in INDEX.json: docs/results/d/notes.md",
    ]
    table = render_table(rows, "t")
    assert table.splitlines()[4] == f"| `docs/results/d/a.json` | `abc1234` | CPU | `x` | `{rows[0]['sha256']}` |"


def main(argv: list[str]) -> int:
    if argv not in (["--write-tables"], ["--refresh"]):
        print(__doc__, file=sys.stderr)
        return 2
    doc = json.loads(INDEX.read_text())
    if argv == ["--refresh"]:
        for r in doc["files"]:
            p = ROOT / r["path"]
            r["sha256"], r["bytes"] = sha256(p), p.stat().st_size
        INDEX.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    write_tables(doc["files"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
