"""The README is a front door and docs/ holds the rest: every link inside the repository
resolves, no page links outside it, and no user document carries a development diary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_short_and_links_every_docs_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    linked = {m.group(1) for m in LINK.finditer(text)}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in linked, f"README does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository_and_resolve(page):
    text = page.read_text()
    assert not re.search(r"https?://", text), "no links outside the repository"
    assert "../shared" not in text
    for target in (m.group(1) for m in LINK.finditer(text)):
        path = target.split("#")[0]
        if path:
            assert (page.parent / path).exists(), f"{page.name} links {target}, which does not exist"


# A development diary: issue / task / helper numbers, "targets (issue 14)", reviewers' names.
DIARY = re.compile(r"\b(issue|task|helper)[ -]?#?\d+|\bhelper H\d|\bthe lead\b|\bsessions?\b", re.I)


@pytest.mark.parametrize("page", PAGES + RESULTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_diary(page):
    found = [m.group(0) for m in DIARY.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)}: {found}"
