"""Every "SPEC §N" citation in the repository resolves to a section of ``docs/SPEC.md``.

The numerical contract lives in the repository (``docs/SPEC.md``); README, ``--help`` texts,
docstrings and error messages cite it as ``SPEC §3``, ``SPEC §3.1``, ``SPEC §3 rule 4``. A citation of
a section or rule the file does not have is a dangling reference, and so is a bare "SPEC rule N"
(which section?).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "SPEC.md"
CITATION = re.compile(r"SPEC(?:\.md)?\s*§\s*(\d+(?:\.\d+)?)(?:\s+rules?\s+(\d+)(?:\s*[-–]\s*(\d+))?)?")
BARE_RULE = re.compile(r"SPEC(?:\.md)?\s+rules?\s+\d")


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("src/**/*.py"),
             *ROOT.glob("src/**/*.yaml"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("tests/**/*.py")]
    return [f for f in files if f.is_file() and f != SPEC]


def spec_sections() -> tuple[set[str], dict[str, set[int]]]:
    """Section numbers of ``docs/SPEC.md`` (``## §3 ...`` / ``### §3.1 ...``) and the numbered rules of each."""
    sections: set[str] = set()
    rules: dict[str, set[int]] = {}
    current = None
    for line in SPEC.read_text().splitlines():
        m = re.match(r"#{2,4}\s+§(\d+(?:\.\d+)?)\s", line)
        if m:
            current = m.group(1)
            sections.add(current)
            continue
        r = re.match(r"(\d+)\.\s+\*\*", line)
        if r and current is not None:
            rules.setdefault(current, set()).add(int(r.group(1)))
    return sections, rules


def test_spec_has_the_sections_of_the_contract():
    sections, rules = spec_sections()
    assert {"1", "2", "3", "3.1", "3.2", "4", "5"} <= sections
    assert rules["3"] == {1, 2, 3, 4, 5, 6}
    text = SPEC.read_text()
    for formula in ("S_enc   = fl(2688 / amax)", "α = fl(S_dec_X · S_dec_W)", "γ_K = K·u / (1 − K·u)", "K3", "c̄ = min(c, C)"):
        assert formula in text, formula


def test_every_spec_citation_resolves():
    sections, rules = spec_sections()
    bad, seen = [], 0
    for f in _sources():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            where = f"{f.relative_to(ROOT)}:{n}"
            if f.name == "test_docs_spec.py":
                continue
            for m in CITATION.finditer(line):
                seen += 1
                sec, r1, r2 = m.group(1), m.group(2), m.group(3)
                if sec not in sections:
                    bad.append(f"{where}: {m.group(0)!r}: docs/SPEC.md has no §{sec}")
                for r in (r1, r2):
                    if r is not None and int(r) not in rules.get(sec, set()):
                        bad.append(f"{where}: {m.group(0)!r}: §{sec} has no rule {r}")
            if BARE_RULE.search(line):
                bad.append(f"{where}: a rule without its section ({BARE_RULE.search(line).group(0)!r}; write 'SPEC §3 rule N')")
    assert seen > 100  # the code does cite the contract
    assert bad == [], "\n".join(bad)


def test_the_resolver_flags_a_missing_section_and_rule(tmp_path):
    sections, rules = spec_sections()
    m = CITATION.search("see SPEC §7 rule 2")
    assert m and m.group(1) not in sections
    m = CITATION.search("SPEC §3 rule 9")
    assert m and int(m.group(2)) not in rules["3"]
    assert BARE_RULE.search("(SPEC rule 2)")
