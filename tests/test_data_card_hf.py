"""data_cards/hf.md's worked example, executed as written: its Python block builds the digits
dataset (save_to_disk and imagefolder), its recipe trains on each for two steps through the
command line, and ``mmviews prepare hf --recipe`` checks the copy. A card that drifts from the
code (a renamed option, a column, a split) fails here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import datasets  # noqa: F401  (the card's script needs it: a declared dependency, imported, not skipped)
import pytest
import sklearn  # noqa: F401  (the card's script loads the digits with it: the dev extra's scikit-learn)
import yaml

from mmviews.cli import main
from mmviews.resources import data_card

CARD = data_card("hf")


def blocks(language: str) -> list[str]:
    assert CARD is not None, "data_cards/hf.md is missing"
    return re.findall(rf"```{language}\n(.*?)```", CARD.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where the card's script has run (it writes data/digits_disk and data/digits_folder)."""
    folder = tmp_path_factory.mktemp("card")
    (script,) = blocks("python")
    (folder / "make_digits.py").write_text(script)
    subprocess.run([sys.executable, "make_digits.py"], cwd=folder, check=True, capture_output=True, timeout=300)
    return folder


def train_two_steps(folder: Path, recipe: Path, run: str, capsys: pytest.CaptureFixture[str]) -> dict:
    rc = main(["train", str(recipe), "--output", run, "--set", "optimisation.max_steps=2",
               "--set", "evaluation.random_baseline=false", "--set", "evaluation.tasks=[knn:class]",  # the cheapest probe
               "--set", "evaluation.plots=false"])  # (the report's PNGs: a second of matplotlib, checked elsewhere)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads((folder / run / "results.json").read_text())


def test_card_recipe_on_the_save_to_disk_copy(workdir: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(workdir)
    recipe_text = blocks("yaml")[0]
    (workdir / "digits.yaml").write_text(recipe_text)
    assert main(["prepare", "hf", "data/digits_disk", "--recipe", "digits.yaml"]) == 0
    out = capsys.readouterr().out
    assert "split train:" in out and "rows: 1437" in out and "split test:" in out and "rows: 360" in out
    assert "image: column 'image', image" in out and "class: column 'label', 10 classes" in out
    results = train_two_steps(workdir, workdir / "digits.yaml", "run_disk", capsys)
    assert results["steps"] == 2
    assert 0.0 <= results["eval"]["test/knn/class/top1"] <= 1.0


def test_card_recipe_on_the_imagefolder_copy(workdir: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(workdir)
    recipe = yaml.safe_load(blocks("yaml")[0])
    recipe["data"] = yaml.safe_load(blocks("yaml")[1])["data"]  # "only the data: block changes"
    (workdir / "digits_folder.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["prepare", "hf", "data/digits_folder", "--recipe", "digits_folder.yaml"]) == 0
    out = capsys.readouterr().out
    assert "rows: 1437" in out and "rows: 360" in out and "10 classes" in out
    results = train_two_steps(workdir, workdir / "digits_folder.yaml", "run_folder", capsys)
    assert results["steps"] == 2 and "test/knn/class/top1" in results["eval"]


def test_prepare_hf_reports_a_wrong_column_and_exits_1(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(workdir)
    recipe = yaml.safe_load(blocks("yaml")[0])
    recipe["data"]["options"]["columns"] = {"image": "img"}
    (workdir / "wrong.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["prepare", "hf", "data/digits_disk", "--recipe", "wrong.yaml"]) == 1
    out = capsys.readouterr().out
    assert "key 'data.options.columns'" in out and "has no column 'img' (for 'image')" in out
    # without a recipe: the default columns, every split of the folder
    assert main(["prepare", "hf", "data/digits_folder"]) == 0
    out = capsys.readouterr().out
    assert "split train:" in out and "split test:" in out
