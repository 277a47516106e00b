"""Every relative link in README.md, BENCHMARKS.md and the docs pages resolves: the file exists and a
``#anchor`` names a heading of the target page (GitHub's slug rule, ``-1``/``-2`` for repeated headings).

Checked: ``[text](target)`` outside code spans and fenced blocks in README.md, BENCHMARKS.md, docs/*.md,
docs/engines/*.md and the topic pages docs/results/*.md (the raw ``.md`` records below docs/results/<dir>/
are run outputs and are not edited). External links (``http``, ``https``, ``mailto``) are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def pages(root: Path = ROOT) -> list[Path]:
    out = [root / "README.md", root / "BENCHMARKS.md"]
    out += sorted((root / "docs").glob("*.md")) + sorted((root / "docs" / "engines").glob("*.md"))
    out += sorted((root / "docs" / "results").glob("*.md"))
    return [p for p in out if p.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading text: lower case, drop what is not a word character, space or hyphen."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for i, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        bare = re.sub(r"`[^`]*`", "", line)
        out += [(i, a or b) for a, b in LINK.findall(bare)]
    return out


def broken_links(docs: list[Path], root: Path = ROOT) -> tuple[int, list[str]]:
    """``(number of relative links checked, ["file:line: target (why)"] for each that does not resolve)``."""
    n, bad = 0, []
    for doc in docs:
        for line, target in links(doc):
            if re.match(r"[a-z]+:", target):
                continue
            n += 1
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(root)}:{line}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with that anchor)")
    return n, bad


def test_every_relative_link_in_the_docs_resolves():
    n, bad = broken_links(pages())
    assert n > 60  # the index pages link every topic page and the moved sections
    assert bad == [], "\n".join(bad)


def test_slug_follows_githubs_rule():
    assert slug("What `qpass apply` does") == "what-qpass-apply-does"
    assert slug("Current same-run table: CUDA kernels on one H100 (issue 28, 2026-12-07)") == (
        "current-same-run-table-cuda-kernels-on-one-h100-issue-28-2026-12-07")
    assert slug("QUADS claims C1–C5: status after issue 13") == "quads-claims-c1c5-status-after-issue-13"


def test_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Top\n\n[ok](#top-1) [ok](b.md#sec) [bad](#nope) `[code](x.md)`\n"
                                   "```\n[in fence](gone.md)\n```\n[gone](gone.md) [web](https://example.com)\n")
    (tmp_path / "b.md").write_text("## Sec\n")
    n, bad = broken_links([tmp_path / "a.md"], tmp_path)
    assert n == 4
    assert bad == ["a.md:5: #nope (no heading with that anchor)", "a.md:9: gone.md (no such file)"]
