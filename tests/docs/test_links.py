"""Every link in README.md and docs/ points at a file of the repository, and at a heading of
it when it names one (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples/README.md"]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+)$")


def _without_code(text: str) -> str:
    """The text outside fenced blocks and inline code (a `[x](y)` there is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for line in text.splitlines():
        if match := _HEADING.match(line):
            slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    return _LINK.findall(_without_code(page.read_text()))


def test_the_pages_have_links() -> None:
    assert len(links(ROOT / "README.md")) >= 20
    assert all(
        (ROOT / "docs" / name).exists()
        for name in (
            "configuration.md",
            "dispatch-and-failures.md",
            "metrics.md",
            "simulator.md",
            "benchmarks.md",
            "deployment.md",
            "development.md",
        )
    )


def test_anchors_follow_github() -> None:
    assert "plain-envoy-pd-extproc-up" in anchors(ROOT / "docs/deployment.md")
    assert "kubernetes--envoy--pd-extproc-in-one-pod" in anchors(ROOT / "examples/README.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT)}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_fence_is_closed() -> None:
    """An unclosed ``` made the rest of the old README render as code."""
    for page in PAGES:
        fences = [line for line in page.read_text().splitlines() if line.startswith("```")]
        assert len(fences) % 2 == 0, f"{page.relative_to(ROOT)}: a code fence is never closed"
