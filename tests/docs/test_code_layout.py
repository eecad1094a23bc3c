"""docs/development.md names every module of extproc/ in its folder-by-folder tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tree() -> str:
    doc = (ROOT / "docs" / "development.md").read_text()
    section = doc[doc.index("### `extproc/`, folder by folder") :]
    return section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n") + 4)]


def _named(tree: str) -> set[str]:
    """The modules the tree names, as paths below extproc/ (`folder/` lines open a folder)."""
    named, folder = set(), ""
    for line in tree.splitlines()[1:]:
        head = re.match(r"  (\S+/)", line)
        if head:
            folder = head.group(1)
        elif re.match(r"  \S", line):
            folder = ""
        for module in re.findall(r"\b([a-z_][a-z0-9_]*\.py)\b", line):
            named.add(folder + module)
    return named


def test_every_module_of_the_sidecar_is_in_the_tree() -> None:
    modules = {
        str(path.relative_to(ROOT / "extproc"))
        for path in (ROOT / "extproc").rglob("*.py")
        if path.name != "__init__.py" and "policies" not in path.parts
    }
    bootstrap = {m for m in modules if m.startswith("bootstrap/")}
    named = _named(_tree())
    named |= {f"bootstrap/{m}.py" for m in re.findall(r"\b([a-z_]+)\b", _tree())} & bootstrap
    assert sorted(modules - named) == []


def test_the_tree_names_no_module_that_is_gone() -> None:
    named = {m for m in _named(_tree()) if not m.startswith(("bootstrap/", "protocol/"))}
    missing = [m for m in named if not (ROOT / "extproc" / m).exists()]
    assert missing == []
