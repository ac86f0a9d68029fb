"""The docs' links: the lab notebook's index names every section and subsection of its
month files with a working anchor, and every relative link in README.md and docs/ leads
to a file (and, into a markdown file, to a heading) that exists."""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).parents[1]
NOTES = ROOT / "docs" / "perf-notes"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = (c for c in heading.strip().lower()
            if c in " -" or unicodedata.category(c)[0] in "LM" or unicodedata.category(c) in ("Nd", "Pc"))
    return "".join("-" if c == " " else c for c in kept)


def _headings(path: Path, max_level: int = 6) -> list[str]:
    """The anchors of a markdown file's headings, numbered as GitHub numbers repeats."""
    anchors, seen = [], {}
    for line in path.read_text().splitlines():
        match = re.match(r"(#{1,6}) (.*)", line)
        if match:
            base = _anchor(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            if len(match.group(1)) <= max_level:
                anchors.append(base if count == 0 else f"{base}-{count}")
    return anchors


def test_the_notebook_index_is_complete():
    linked = set(LINK.findall((NOTES / "README.md").read_text()))
    months = sorted(NOTES.glob("20*.md"))
    assert months
    sections = {f"{month.name}#{anchor}" for month in months for anchor in _headings(month, max_level=2)}
    assert sections - linked == set(), "sections missing from docs/perf-notes/README.md's index"


def test_relative_links_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists() or anchor and (dest.suffix != ".md" or anchor not in _headings(dest)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []
