"""The pages of ``docs/`` (and the README) show what runs: every ```python block of a page runs as
written (one namespace per page, from an empty folder), every ``mmviews`` command line of a
```bash block is accepted by that command's own argument parser, and every relative link
points at a file of the repository. A block that cannot run here is marked as in the README
(``<!-- not-run: REASON -->`` on the line before its fence)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from test_readme import python_blocks

from mmviews.cli import COMMANDS, command_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
_BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def command_lines(text: str) -> list[tuple[int, list[str]]]:
    """``(line number, argv after 'mmviews')`` of each mmviews invocation in the ```bash blocks:
    ``mmviews ...``, ``.venv/bin/mmviews ...``, ``python -m mmviews.cli ...`` and
    ``accelerate launch ... -m mmviews.cli ...``; continuation lines joined, comments dropped,
    ``&&``-chained commands split."""
    found = []
    for block in _BASH.finditer(text):
        start = text.count("\n", 0, block.start()) + 2
        joined, first = "", None
        for offset, line in enumerate(block.group(1).split("\n")):
            first = start + offset if first is None else first
            joined += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
            if line.rstrip().endswith("\\"):
                continue
            for part in joined.split("&&"):
                words = shlex.split(part, comments=True)
                for i, word in enumerate(words):
                    if word.endswith("bin/mmviews") or word == "mmviews" or (
                            word == "mmviews.cli" and i > 0 and words[i - 1] == "-m"):
                        found.append((first, words[i + 1:]))
                        break
            joined, first = "", None
    return found


def test_command_lines_are_found():
    text = ("```bash\nmmviews train quickstart  # a comment\n.venv/bin/pip install x && .venv/bin/mmviews list recipes\n"
            "accelerate launch --multi_gpu \\\n    -m mmviews.cli train q --set cpu=true\n```\n")
    assert command_lines(text) == [(2, ["train", "quickstart"]), (3, ["list", "recipes"]),
                                   (4, ["train", "q", "--set", "cpu=true"])]


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_mmviews_command_line_parses(page: Path):
    for line, argv in command_lines(page.read_text()):
        assert argv and argv[0] in COMMANDS, f"{page.name}:{line}: unknown command {argv[:1]}"
        _, parser = command_parser(argv[0])
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{page.name}:{line}: mmviews {shlex.join(argv)} is refused by its parser")


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_point_at_files(page: Path):
    for target in _LINK.findall(page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name}: link to {target} points at nothing"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_python_blocks_of_each_page_run(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MMVIEWS_RECIPES", raising=False)
    namespace: dict = {"__name__": "__docs__"}
    for line, code, reason in python_blocks(page.read_text()):
        if reason is not None:
            continue
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"{page.name} python block at line {line} failed: {type(error).__name__}: {error}")


def test_the_readme_stays_short():
    """A newcomer reads it in ten minutes: reference material lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
