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


# --- claims of the pages that the code can check -----------------------------------------------------


def _bash_lines(text: str) -> list[str]:
    """The command lines of the ```bash blocks, continuation lines joined, comment lines dropped."""
    lines = []
    for block in _BASH.finditer(text):
        joined = ""
        for line in block.group(1).split("\n"):
            if line.lstrip().startswith("#"):
                continue
            joined += line.rstrip().rstrip("\\") + " "
            if not line.rstrip().endswith("\\"):
                lines.append(" ".join(joined.split()))
                joined = ""
    return [line for line in lines if line]


def test_bash_lines_are_joined_without_their_comments():
    text = "```bash\n# a comment\nA=1 accelerate launch --x \\\n    -m mmviews.cli train R\nls\n```\n"
    assert _bash_lines(text) == ["A=1 accelerate launch --x -m mmviews.cli train R", "ls"]


@pytest.mark.parametrize("key", ["checkpoint_every", "keep_last"])
def test_the_checkpoint_keys_are_documented_with_their_defaults(key: str):
    """A fault-tolerant run is set by these two keys: docs/reliability.md's table states each with
    the default OutputConfig has."""
    from mmviews.config import OutputConfig

    text = (ROOT / "docs" / "reliability.md").read_text()
    row = re.search(rf"^\| `output\.{key}` \| `([^`]+)` \| (.+) \|$", text, re.M)
    assert row, f"no table row for output.{key} in docs/reliability.md"
    assert row.group(1) == str(getattr(OutputConfig(), key))


def test_the_keep_last_warning_is_shown_as_printed():
    """docs/reliability.md shows the warning that --check and the run's start print for the
    quickstart (keep_last 1) under auto_resume, word for word, and its example keeps 2."""
    from mmviews.config import load_config, resolve_recipe
    from mmviews.notices import warning_line
    from mmviews.train.resume import AUTO_RESUME_KEEP_LAST, auto_resume_lines

    config = load_config(resolve_recipe("quickstart"), ["output.auto_resume=true"])
    assert config.output.keep_last < AUTO_RESUME_KEEP_LAST == 2  # the case the page explains
    (line,) = auto_resume_lines(config)
    text = (ROOT / "docs" / "reliability.md").read_text()
    assert f"\n{warning_line('mmviews train', line)}\n" in text
    example = next(c for c in _bash_lines(text) if "output.auto_resume=true" in c and c.startswith("mmviews train"))
    assert "--set output.keep_last=2" in example
    assert not auto_resume_lines(load_config(resolve_recipe("quickstart"),
                                             ["output.auto_resume=true", "output.keep_last=2"]))


def test_every_documented_restart_line_has_the_rendezvous_it_needs():
    """A launch line with --max_restarts has what restarted workers need to rejoin (what
    mmviews.train.resume.restart_setup_lines checks, and test_train_faults' restart runs with),
    on GPUs and on CPUs; both pages give a CPU line (gloo: --set cpu=true)."""
    cpu_pages = set()
    for page in [ROOT / "README.md", *PAGES]:
        for line in _bash_lines(page.read_text()):
            if "--max_restarts" not in line:
                continue
            assert "--rdzv_backend c10d" in line and line.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "), \
                f"{page.name}: {line}"
            assert re.search(r"--main_process_port \d+ ", line), f"{page.name}: {line}"  # not c10d's shared 29400
            assert "--set output.auto_resume=true" in line, f"{page.name}: {line}"
            if "--set cpu=true" in line:
                cpu_pages.add(page.name)
    assert cpu_pages == {"distributed.md", "reliability.md"}


def test_the_hung_worker_default_is_the_configs():
    from mmviews.config import DistributedConfig

    default = DistributedConfig().timeout_s
    assert f"The default, {default:g} s, is long on purpose" in (ROOT / "docs" / "reliability.md").read_text()
    assert f"`distributed.timeout_s` (default {default:g})" in (ROOT / "docs" / "distributed.md").read_text()


def test_the_readme_sample_names_its_build_and_its_ratio_is_its_own():
    """The README's sample output says which torch printed it (the version CI pins), and the
    sentence under it reads its R@1 ratio off the sample itself."""
    text = (ROOT / "README.md").read_text()
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints" / "ci.txt").read_text(), re.M).group(1)
    assert f"PyPI's default torch build, torch {pinned}+" in text
    sample = text[text.index("```text\nrun folder: runs/quickstart"):]
    sample = sample[:sample.index("\n```\n")]
    row = re.search(r"test/retrieval/mean/R@1 +trained (\S+) +random init \S+ +\(\S+\) +chance (\S+)", sample)
    ratio = round(float(row.group(1)) / float(row.group(2)))
    assert f"a view finds the other views of its own sample {ratio} times as often as chance" in text
    loss = re.search(r"final loss (\d+\.\d+)", sample).group(1)
    assert f"final loss {loss}" not in text.replace(sample, "")  # the other build's loss is another number


def test_the_thread_advice_is_given_where_runs_are_launched():
    performance = (ROOT / "docs" / "performance.md").read_text()
    assert "## Threads on a CPU" in performance and "OMP_NUM_THREADS=1" in performance
    assert "bit-identical only at equal thread counts" in performance
    assert "performance.md#threads-on-a-cpu" in (ROOT / "docs" / "distributed.md").read_text()
    assert "performance.md#threads-on-a-cpu" in (ROOT / "README.md").read_text()
