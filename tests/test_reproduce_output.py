"""Where the reproduction scripts of recipes/reproduce/ write: one rule (``_common.output_dir``)
for every script. By default under ``runs/reproduce/<name>/`` of the current directory, or
``--out``; never into the repository, whose shipped tables (``recipes/reproduce/results/``)
change only with ``--update-shipped`` and never from ``--smoke``. A smoke run's first line says
its numbers test the plumbing only, and a one-seed standard deviation prints ``-``.

The rule and each script's use of it are checked without training (each refusal comes before
the first write); the smoke runs that end in a temporary folder with the repository unchanged
are in test_reproduce_recipes.py and test_reproduce_gaussian.py (they run there anyway), and
identifiability's below (slow)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest
from repo_state import changes, repository_state, repository_unchanged

REPRO = Path(__file__).resolve().parents[1] / "recipes" / "reproduce"
SCRIPTS = ("er_batch_size", "fmicl_similarity", "identifiability", "identifiability_tune", "ipmc_ablation",
           "polyview_gaussian", "temperature_siglip", "view_multiplicity")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"reproduce_out_{name}", REPRO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # polyview_gaussian's dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def common():
    return _load("_common")


def _parser(common) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="script")
    common.add_size_arguments(parser)
    common.add_output_arguments(parser, "thing")
    return parser


def _refusal(common, argv: list[str], capsys) -> str:
    parser = _parser(common)
    with pytest.raises(SystemExit) as stop:
        common.output_dir(parser, parser.parse_args(argv), "thing")
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_the_default_folder_is_the_users_and_out_is_taken_as_given(common, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    parser = _parser(common)
    assert common.output_dir(parser, parser.parse_args([]), "thing") == tmp_path / "runs" / "reproduce" / "thing"
    assert common.output_dir(parser, parser.parse_args(["--out", "mine"]), "thing") == tmp_path / "mine"
    assert common.output_dir(parser, parser.parse_args(["--out", str(tmp_path / "x")]), "thing") == tmp_path / "x"
    assert capsys.readouterr().out == ""  # no smoke: nothing printed
    help_text = " ".join(parser.format_help().split())
    assert "output folder (default: runs/reproduce/thing/ under the current directory)" in help_text
    assert "--update-shipped write into the tables shipped with the repository, recipes/reproduce/results/thing/" \
        in help_text


def test_a_smoke_run_says_first_that_its_numbers_test_the_plumbing(common, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    parser = _parser(common)
    assert common.output_dir(parser, parser.parse_args(["--smoke"]), "thing") == tmp_path / "runs/reproduce/thing"
    assert capsys.readouterr().out == common.SMOKE_NOTICE + "\n"
    assert "test the plumbing only" in common.SMOKE_NOTICE
    # polyview_gaussian's size is an argument of its own (args.size)
    assert common.output_dir(parser, argparse.Namespace(size="smoke", out=None, update_shipped=False), "thing")
    assert capsys.readouterr().out == common.SMOKE_NOTICE + "\n"


def test_the_shipped_tables_need_the_flag_and_never_take_a_smoke_run(common, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shipped = common.RESULTS_DIR.resolve()
    inside = str(shipped / "thing")
    assert _refusal(common, ["--out", inside], capsys) == (
        f"script: error: --out {inside}: inside the tables shipped with the repository ({shipped}); "
        "pass --update-shipped to regenerate them, or choose another folder")
    # the folder itself, and a relative path that lands there
    _refusal(common, ["--out", str(shipped)], capsys)
    monkeypatch.chdir(shipped.parent)
    _refusal(common, ["--out", "results/other"], capsys)
    monkeypatch.chdir(tmp_path)
    parser = _parser(common)
    assert common.output_dir(parser, parser.parse_args(["--update-shipped"]), "thing") == shipped / "thing"
    assert common.output_dir(parser, parser.parse_args(["--update-shipped", "--out", inside + "_b"]), "thing") \
        == shipped / "thing_b"
    assert _refusal(common, ["--update-shipped", "--smoke"], capsys) == (
        "script: error: --update-shipped with --smoke: smoke numbers test the plumbing only and are never shipped")
    assert _refusal(common, ["--update-shipped", "--out", "elsewhere"], capsys) == (
        f"script: error: --update-shipped: --out elsewhere is not under {shipped}, the shipped tables")
    # a sibling whose name starts like the shipped folder is not inside it
    sibling = shipped.parent / (shipped.name + "_mine")
    assert common.output_dir(parser, parser.parse_args(["--out", str(sibling)]), "thing") == sibling


def test_a_one_seed_std_is_unknown_and_prints_a_dash(common):
    mean, std = common.mean_std([0.5])
    assert mean == 0.5 and math.isnan(std)
    assert common.mean_std([0.5, float("nan")])[0] == 0.5 and math.isnan(common.mean_std([0.5, float("nan")])[1])
    mean, std = common.mean_std([1.0, 3.0])
    assert (mean, std) == (2.0, pytest.approx(math.sqrt(2.0)))
    assert all(math.isnan(v) for v in common.mean_std([]))
    table = common.markdown_table([{"acc": 0.5, "acc_std": math.nan, "acc_std_cosine": math.nan, "erank": math.nan,
                                    "seeds": 1}, {"acc": 0.25, "acc_std": 0.125}],
                                  ["acc", "acc_std", "acc_std_cosine", "erank", "seeds"])
    assert table.splitlines() == ["| acc | acc_std | acc_std_cosine | erank | seeds |", "|---|---|---|---|---|",
                                  "| 0.500 | - | - | nan | 1 |", "| 0.250 | 0.125 |  |  |  |"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_writes_by_the_rule(script: str, tmp_path: Path, monkeypatch, capsys):
    """Each script's arguments go through the rule: the shipped tables are refused without the
    flag and with --smoke, before anything is written, after the smoke line; its help names
    the default folder."""
    module = _load(script)
    monkeypatch.chdir(tmp_path)
    inside = str(REPRO / "results" / script)
    with repository_unchanged():
        for argv in (["--smoke", "--out", inside], ["--smoke", "--update-shipped"]):
            with pytest.raises(SystemExit) as stop:
                module.main(argv)
            assert stop.value.code == 2
            captured = capsys.readouterr()
            assert captured.out.splitlines()[0].startswith("--smoke: tiny data and a few steps; these numbers test "
                                                           "the plumbing only")
            assert "--update-shipped" in captured.err.splitlines()[-1]
        with pytest.raises(SystemExit):
            module.main(["--help"])
    assert "runs/reproduce/" in " ".join(capsys.readouterr().out.split())
    assert list(tmp_path.iterdir()) == []


def test_the_repository_listing_sees_every_kind_of_change(tmp_path: Path):
    """The check the smoke tests rely on: a new, a removed, a rewritten and an atomically
    replaced file all show, in a git-ignored folder too."""
    (tmp_path / "cache").mkdir()
    for name in ("kept", "gone", "rewritten", "replaced"):
        (tmp_path / "cache" / name).write_text("x")
    (tmp_path / "__pycache__").mkdir()
    before = repository_state(tmp_path)
    (tmp_path / "cache" / "gone").unlink()
    (tmp_path / "cache" / "rewritten").write_text("xy")
    (tmp_path / "cache" / "new").write_text("x")
    (tmp_path / "other").write_text("x")
    (tmp_path / "other").replace(tmp_path / "cache" / "replaced")
    (tmp_path / "__pycache__" / "m.pyc").write_text("x")  # Python's own cache is not a change
    assert changes(before, repository_state(tmp_path)) == [
        "added cache/new", "changed cache/replaced", "changed cache/rewritten", "removed cache/gone"]


@pytest.mark.slow
def test_the_identifiability_smoke_run_leaves_the_repository_unchanged(tmp_path: Path, monkeypatch, capsys):
    """The issue's case (``identifiability.py --smoke`` replaced six shipped tables): part a at
    smoke size, run from a temporary folder with no --out."""
    module = _load("identifiability")
    monkeypatch.chdir(tmp_path)
    with repository_unchanged():
        assert module.main(["--smoke", "--part", "a", "--jobs", "1"]) == 0
    out = tmp_path / "runs" / "reproduce" / "identifiability"
    assert (out / "paper_table.csv").is_file() and (out / "runs").is_dir()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("--smoke: tiny data and a few steps; these numbers test the plumbing only")
    row = next(line for line in printed if line.startswith("| both | content |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "-" and cells[6] == "-"  # r2_lin_std and r2_nl_std of one seed
