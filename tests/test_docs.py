"""The README and docs/ as a user reads them: the README one page (at most 250 lines), every link to a
file or a heading of ours resolves, nothing points where a user cannot follow, and the architecture's
module map names every module the package has."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(page):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered."""
    anchors, seen = set(), {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_the_readme_is_one_page():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to docs/ (at most {README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_to_our_files_and_headings_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if ROOT in file.parents else file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_point_only_where_a_user_can_follow(page):
    """No path outside the repository, no issue numbers of a tracker users do not see."""
    text = page.read_text()
    assert "../shared" not in text and not re.search(r"\bissue #?\d+", text, re.IGNORECASE), page.name


def test_the_architecture_maps_every_module():
    modules = {p.name for p in (ROOT / "hvd_compress").glob("*.py")}
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("## Modules"):text.index("## One step")]
    missing = sorted(m for m in modules if m not in block)
    assert not missing, f"docs/architecture.md's module map lacks {missing}"
