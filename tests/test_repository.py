"""The repository's own housekeeping: no text names a tracker's issue number ("issue 34" means
nothing to a user or a contributor), every test file and test id that ``tests/README.md`` and
``tests/mutation/modules.toml`` name exists, every test file is named after its unit (no
``*_guards.py``) and opens with a docstring saying what it guards."""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# Folders that hold no text of the project's own: caches, environments, build and mutation outputs.
SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", "mutants", ".mutmut-cache", ".mutation", "node_modules",
                ".pytest_cache", ".ruff_cache", ".mypy_cache"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".sh", ".rst"}
# "issue 34", "issues 27 and 28", "Issue #5", "item 7 of issue 35"; a bare "#34" where prose stands.
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+|(?:^|[\s(])#\d{2,}\b(?![\w-])", re.IGNORECASE)
# `test_x.py` or `test_x.py::test_name` as README.md and modules.toml write them.
NAMED_TEST = re.compile(r"\b(test_\w+\.py)(?:::(\w+))?")


def _project_text_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in parts[:-1]):
            continue
        if path.suffix in TEXT_SUFFIXES and path.is_file():
            files.append(path)
    return files


def issue_numbers(text: str) -> list[str]:
    """The issue numbers ``text`` names, as written."""
    return [m.group(0).strip() for m in ISSUE_NUMBER.finditer(text)]


@pytest.mark.parametrize("text,found", [
    ("guards of issue 34 were broken", ["issue 34"]), ("(Issue #5)", ["Issue #5"]), ("issues 27", ["issues 27"]),
    ("see #123 above", ["#123"]), ("(#42)", ["(#42"]),
    ("a non-finite loss issues a warning", []), ("colour #1f77b4", []), ("step 34 of the issue", []),
    ("the 2-core machine", []), ("`#0`", []),
])
def test_issue_numbers_are_recognised(text: str, found: list[str]) -> None:
    assert issue_numbers(text) == found


def test_no_issue_numbers_in_the_repository() -> None:
    here = Path(__file__).resolve()
    found = []
    for path in _project_text_files():
        if path == here:  # this file spells the pattern out to test it
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{number}: {hit}" for hit in issue_numbers(line)]
    assert not found, "issue numbers mean nothing to a user; say what the text means instead:\n" + "\n".join(found)


@functools.cache
def _defined_names(path: Path) -> set[str]:
    """The functions and classes a file defines at its top level (tests and the ``check_*`` guards
    they share), read without importing it."""
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _named_tests() -> list[tuple[str, str, str | None]]:
    """(where, file, test or None) for every test file and test id README.md and modules.toml name."""
    named = [("tests/README.md", f, t) for f, t in NAMED_TEST.findall((TESTS / "README.md").read_text())]
    table = tomllib.loads((TESTS / "mutation" / "modules.toml").read_text())
    for module, row in table["modules"].items():
        for entry in [*row.get("tests", []), *row.get("deselect", [])]:
            named += [(f"modules.toml {module}", f, t) for f, t in NAMED_TEST.findall(entry)]
    return [(where, file, test or None) for where, file, test in named]


def test_readme_and_mutation_table_name_existing_tests() -> None:
    named = _named_tests()
    assert len(named) > 50  # both tables were read
    missing = []
    for where, file, test in named:
        path = TESTS / file
        if not path.is_file():
            missing.append(f"{where}: {file} does not exist")
        elif test is not None and test not in _defined_names(path):
            missing.append(f"{where}: {file} defines no {test}")
    assert not missing, "\n".join(missing)


def test_test_files_are_named_by_unit_and_say_what_they_guard() -> None:
    files = sorted(TESTS.glob("test_*.py"))
    assert len(files) > 50
    assert [f.name for f in files if f.stem.endswith("_guards")] == []
    assert [f.name for f in files if not ast.get_docstring(ast.parse(f.read_text()))] == []
