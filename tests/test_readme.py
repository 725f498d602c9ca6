"""Everything README.md shows as Python runs as written.

The ```python blocks are executed in order, in one namespace (as a reader would paste them
into one session), from an empty temporary folder, so run folders they create land there. A
block that cannot run here is marked by an HTML comment on the line before its fence,
``<!-- not-run: REASON -->``; the reason is required. The names the blocks import from mmviews
must be public: listed in the ``__all__`` of the module they come from.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(\S.*?)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line number, code, not-run reason or None)`` for each ```python block."""
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _NOT_RUN.search(before)
        blocks.append((line, match.group(1), marker.group(1) if marker else None))
    return blocks


def test_block_extraction_and_marker():
    text = "x\n```python\na = 1\n```\n<!-- not-run: needs a GPU -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n", None), (6, "b = 2\n", "needs a GPU")]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2, "the README's Python examples went missing"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MMVIEWS_RECIPES", raising=False)
    namespace: dict = {"__name__": "__readme__"}
    ran = 0
    for line, code, reason in blocks:
        if reason is not None:
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:  # name the block: the traceback's file name is README.md:LINE
            pytest.fail(f"README.md python block at line {line} failed: {type(error).__name__}: {error}")
        ran += 1
    assert ran >= 2
    assert (tmp_path / "runs" / "quickstart-tiny" / "encoder" / "README.md").is_file()  # the API block trained


def test_ci_runs_the_readme_test_command():
    """``.ci/run`` runs the README's test command verbatim (install with the extras the tests
    need, then pytest)."""
    ci = (README.parent / ".ci" / "run").read_text()
    commands = [line for line in re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.S) if "pytest" in line]
    assert len(commands) == 1, commands
    assert commands[0] in ci.splitlines(), (commands[0], ci)
    assert "tensorboard" in commands[0]  # the trackers test must run in CI


def test_readme_imports_are_public():
    seen = 0
    for line, code, _ in python_blocks(README.read_text()):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mmviews":
                module = importlib.import_module(node.module)
                public = getattr(module, "__all__", None)
                assert public is not None, f"README.md:{line}: {node.module} has no __all__"
                for alias in node.names:
                    assert alias.name in public, f"README.md:{line}: {alias.name} is not in {node.module}.__all__"
                    seen += 1
    assert seen >= 5
