"""README's recipe table lists every built-in recipe (a fresh user found 8 of 12 listed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_recipe_table_lists_every_built_in_recipe():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Recipes"):]
    section = section[: section.index("\n### ", 5) if "\n### " in section[5:] else len(section)]
    listed = set(re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.MULTILINE))
    built_in = {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    assert built_in == listed, f"missing from README: {sorted(built_in - listed)}; not built in: {sorted(listed - built_in)}"
