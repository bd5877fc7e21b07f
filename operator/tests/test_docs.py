"""The README and docs/ as a newcomer reads them: every link lands inside the repository, on a file that exists
and a heading it names; the docs index lists every page; the README's first screen has the two commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation dropped, spaces as hyphens, repeats
    numbered."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    return broken


def test_every_link_in_the_readme_and_docs_lands_on_a_file_and_heading_of_the_repository() -> None:
    broken = {str(page.relative_to(ROOT)): broken_links(page) for page in PAGES}
    assert not {page: links for page, links in broken.items() if links}


def test_the_docs_index_links_every_page_and_the_readme_links_the_index() -> None:
    linked = {(DOCS / target.partition("#")[0]).resolve() for target in LINK.findall((DOCS / "index.md").read_text())}
    missing = [page.name for page in DOCS.glob("*.md") if page.name != "index.md" and page.resolve() not in linked]
    assert not missing, "docs/index.md links every page under docs/"
    assert "docs/index.md" in LINK.findall((ROOT / "README.md").read_text())


def test_the_readmes_first_screen_has_the_two_commands_and_ci_runs_the_test_command() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert re.search(r"^make demo ", first_screen, flags=re.MULTILINE)
    assert re.search(r"^make test ", first_screen, flags=re.MULTILINE)
    assert re.search(r"^make unit ", first_screen, flags=re.MULTILINE)
    assert "exec make test\n" in (ROOT / ".ci" / "run").read_text()
