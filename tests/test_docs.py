"""The docs are reference, not run logs: bounded in size, no measurement-history markers, no paragraph too long to
read, no link that leaves the repository or points at nothing. Measurement history belongs in bench/README.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS]

README_WORDS = 1200
DOCS_WORDS = 30_000
PARAGRAPH_WORDS = 150
RUN_LOG = re.compile(r"\bstop \d+\b|\bthis round\b|\bload average\b|\bcommitted run\b", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _words(path: Path) -> int:
    return len(path.read_text().split())


def _prose(text: str) -> str:
    """The text without fenced code blocks (a command's output is not prose)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _paragraphs(text: str) -> list[str]:
    """Blocks between blank lines, each list item on its own, tables excluded (a table row is not a paragraph)."""
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", _prose(text))
    return [b for b in blocks if b.strip() and not b.lstrip().startswith("|")]


def test_readme_is_a_front_door():
    assert _words(ROOT / "README.md") <= README_WORDS


def test_docs_fit_their_budget():
    words = {p.name: _words(p) for p in DOCS}
    assert sum(words.values()) <= DOCS_WORDS, sorted(words.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_run_log_markers(page):
    hits = [m.group(0) for m in RUN_LOG.finditer(page.read_text())]
    assert hits == [], f"{page.name}: measurement history belongs in bench/README.md: {hits}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_paragraphs_are_short(page):
    long = [(len(p.split()), p[:80]) for p in _paragraphs(page.read_text()) if len(p.split()) > PARAGRAPH_WORDS]
    assert long == []


@pytest.mark.parametrize("page", [*PAGES, ROOT / "bench" / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_in_the_repository(page):
    bad = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(target)
    bad += re.findall(r"\.\./shared/\S*", page.read_text())  # a path outside the project, linked or not
    assert bad == [], f"{page.name}: links outside the repository or to nothing: {bad}"


SECTION_REF = re.compile(r'docs/(\w+)\.md,? "([^"\n]+(?:\n[ #]*[^"\n]+)?)"')


def test_sections_the_code_cites_exist():
    """Code comments cite doc sections by title (`docs/kvcache.md, "One arena"`): each must still be a heading."""
    headings = {p.stem: [re.sub(r"^#+\s*", "", line).strip("` ").lower() for line in p.read_text().splitlines()
                         if line.startswith("#")] for p in DOCS}
    missing = []
    for path in [*ROOT.glob("*/**/*.py"), *ROOT.glob("compose/*.yml")]:
        if ".venv" in path.parts:
            continue
        for doc, title in SECTION_REF.findall(path.read_text()):
            title = " ".join(title.replace("#", " ").split()).strip("` ").lower()
            if not any(h.startswith(title) for h in headings.get(doc, [])):
                missing.append(f"{path.relative_to(ROOT)}: docs/{doc}.md {title!r}")
    assert missing == []
