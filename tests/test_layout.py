"""The tests' own layout: no test module or conftest is imported as a library (shared code lives
in tests/support/), so moving or deleting one test file never breaks another."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).parent


def imported_modules(tree: ast.Module, package: list[str]) -> Iterator[tuple[int, str]]:
    """Every module an import statement may load, dotted, with its line (relative ones resolved)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield node.lineno, module
            for alias in node.names:  # `from tests.x import conftest` imports a module too
                yield node.lineno, f"{module}.{alias.name}"


def is_test_or_conftest(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last == "conftest" or last.startswith("test_")


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        package = ["tests", *path.relative_to(root).parent.parts]
        tree = ast.parse(path.read_text(), str(path))
        for line, module in imported_modules(tree, package):
            if is_test_or_conftest(module):
                found.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
    return found


def test_no_test_module_or_conftest_is_imported() -> None:
    found = violations(TESTS)
    assert not found, "move what is shared into tests/support/:\n" + "\n".join(found)


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_a.py").write_text(
        "import tests.sub.test_b\n"
        "from tests.integration.conftest import topology\n"
        "from .conftest import x\n"
        "from . import test_c\n"
        "from tests.support.topology import topology as fine\n"
        "def f():\n    from tests.deploy.test_examples import config\n"
    )
    assert [v.split(" imports ")[1] for v in violations(tmp_path)] == [
        "tests.sub.test_b",
        "tests.integration.conftest",
        "tests.sub.conftest",
        "tests.sub.test_c",
        "tests.deploy.test_examples",
    ]


def conftest_library(path: Path) -> list[str]:
    """What a conftest.py defines besides fixtures, pytest hooks and their private helpers."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            found.append(f"class {node.name}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            if not (fixture or node.name.startswith(("pytest_", "_"))):
                found.append(f"def {node.name}")
    return found


def test_conftest_files_hold_fixtures_and_hooks_only() -> None:
    found = {
        str(path.relative_to(TESTS.parent)): library
        for path in sorted(TESTS.rglob("conftest.py"))
        if (library := conftest_library(path))
    }
    assert not found, f"move these into tests/support/: {found}"
