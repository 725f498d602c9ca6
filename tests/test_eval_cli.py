"""``mmviews eval RUN``: the recipe's ``evaluation.fuse`` is the fusion the probes use unless
``--fuse`` overrides it, the report's plots are those of the training's evaluation when the
recipe's ``evaluation.plots`` (or ``--set evaluation.plots=...``) is true and none when false,
and the rule about report folders looks at where a folder really is: a path through a link to
the run, or with ``..`` in it, that names the run's own ``eval/`` is refused, and a new folder
inside the run reached that way is recorded as the run's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from crafted_files import cli, copy_run, one_line_error, untrained_run
from test_eval_rerun import folder_digest
from test_train_utils import tiny_config

from mmviews.run import LOG_FILE, read_manifest


@pytest.fixture(scope="module")
def mean_fused_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained run (image and audio views, 24 samples) whose recipe fuses the views by their
    mean (the default is concat) and probes the class."""
    raw = tiny_config(text=False, num_samples=24, tasks=["linear:class"])
    raw["evaluation"]["fuse"] = "mean"
    return untrained_run(tmp_path_factory.mktemp("fuse") / "run", raw)


def _evaluated(capsys, run: Path, *options: str) -> tuple[dict, str]:
    rc, out, err = cli(capsys, "eval", str(run), *options)
    assert rc == 0, err
    folder = Path(out.rsplit("report written to ", 1)[1].split(" ")[0])
    return json.loads((folder / "metrics.json").read_text()), out


@pytest.mark.parametrize("options,fuse", [((), "mean"), (("--fuse", "concat"), "concat")])
def test_eval_fuses_as_the_recipe_says_unless_told_otherwise(mean_fused_run: Path, capsys, options, fuse) -> None:
    metrics, out = _evaluated(capsys, mean_fused_run, *options)
    assert re.search(rf"report written to .*\(precision \w+, seed \d+, fuse {fuse}[;)]", out), out[-300:]
    assert metrics["meta"]["fuse"] == fuse, metrics["meta"]  # evaluate_encoder's own record of what the probes took


# ---------------------------------------------------------------------------------------------
# evaluation.plots: mmviews eval draws the plots the training's evaluation draws, or none
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plotted_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """Two untrained runs, the same but for their recipe's ``evaluation.plots`` (the key), each
    with a training log and the report of the training's own final evaluation
    (:func:`mmviews.train.evaluation.run_evaluation` on the built run) in its ``eval/``."""
    from mmviews.config import load_config
    from mmviews.run import load_trained_encoder
    from mmviews.train import build_run
    from mmviews.train.evaluation import run_evaluation

    runs = {}
    for plots in (True, False):
        raw = tiny_config(text=False, num_samples=16, tasks=["linear:class", "diagnostics"])
        raw["evaluation"]["plots"] = plots
        run = untrained_run(tmp_path_factory.mktemp(f"plots_{plots}") / "run", raw)
        (run / LOG_FILE).write_text("step,loss\n1,2.0\n2,1.5\n")
        encoder, _ = load_trained_encoder(run)
        config = load_config(run / "config.yaml")
        run_evaluation(encoder, build_run(config, source=str(run / "config.yaml")), run / "eval", None,
                       log_csv=run / LOG_FILE)
        runs[plots] = run
    return runs


def plots_of(folder: Path) -> tuple[list[str], list[str]]:
    """``(PNG files in the report folder, the plots its metrics.json lists)``."""
    listed = json.loads((folder / "metrics.json").read_text())["meta"]["plots"]
    return sorted(p.name for p in folder.glob("*.png")), listed


@pytest.mark.parametrize("recipe_plots,options,plots", [
    (True, (), True), (False, (), False),
    (True, ("--set", "evaluation.plots=false"), False), (False, ("--set", "evaluation.plots=true"), True),
], ids=["recipe-true", "recipe-false", "set-false", "set-true"])
def test_eval_draws_the_plots_of_the_training_evaluation_as_the_recipe_says(plotted_runs: dict[bool, Path],
                                                                             tmp_path: Path, capsys, recipe_plots: bool,
                                                                             options: tuple[str, ...],
                                                                             plots: bool) -> None:
    """The same PNGs as the training's evaluation with that setting (training curves, similarity
    histogram, spectrum), or none and the summary's note, whatever the run's own setting when
    ``--set evaluation.plots`` gives one."""
    run = plotted_runs[recipe_plots]
    _, out = _evaluated(capsys, run, "--output", str(tmp_path / "report"), *options)
    drawn, listed = plots_of(tmp_path / "report")
    training_drawn, training_listed = plots_of(plotted_runs[plots] / "eval")
    assert drawn == listed == training_drawn == training_listed, (drawn, listed, training_drawn)
    assert drawn == (["similarity_hist.png", "spectrum.png", "training_curves.png"] if plots else [])
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert ("Plots not drawn (evaluation.plots: false)." in summary) == (not plots)
    assert "report written to" in out


@pytest.mark.parametrize("case", ["recipe-false", "set-false"])
def test_plots_guard_fails_when_eval_ignores_the_setting(plotted_runs: dict[bool, Path], tmp_path: Path, capsys,
                                                         monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Mutation test: with every plot drawn whatever the setting (the old behaviour), the guard
    above fails for the recipe's ``false`` and for ``--set evaluation.plots=false``."""
    from mutations import apply_break

    apply_break("eval_plots_ignore_recipe", monkeypatch.setattr)
    recipe_plots, options = (False, ()) if case == "recipe-false" else (True, ("--set", "evaluation.plots=false"))
    with pytest.raises(AssertionError):
        test_eval_draws_the_plots_of_the_training_evaluation_as_the_recipe_says(plotted_runs, tmp_path, capsys,
                                                                                recipe_plots, options, False)


@pytest.mark.parametrize("name", ["eval", "eval_random", "eval_epoch_2"])
def test_a_path_through_a_link_to_the_run_cannot_name_its_own_evaluation(mean_fused_run: Path, tmp_path: Path,
                                                                          capsys, name: str) -> None:
    link = tmp_path / "link"
    link.symlink_to(mean_fused_run, target_is_directory=True)
    (mean_fused_run / "sub").mkdir(exist_ok=True)
    before = folder_digest(mean_fused_run)
    for output in (link / name, mean_fused_run / "sub" / ".." / name):
        rc, _, err = cli(capsys, "eval", str(mean_fused_run), "--output", str(output))
        assert rc == 2 and f"--output {output} is the run's own evaluation" in one_line_error(err), err
    assert folder_digest(mean_fused_run) == before and not (mean_fused_run / name).exists()


def test_a_new_folder_reached_through_a_link_is_recorded_as_the_runs(mean_fused_run: Path, tmp_path: Path,
                                                                     capsys) -> None:
    """So that ``mmviews train --overwrite`` removes it with the rest of the run."""
    link = tmp_path / "link"
    link.symlink_to(mean_fused_run, target_is_directory=True)
    _evaluated(capsys, mean_fused_run, "--output", str(link / "eval-linked"))
    assert "eval-linked" in read_manifest(mean_fused_run)["created"]


@pytest.mark.parametrize("name,guard", [
    ("eval_fuse_ignores_recipe", lambda run, tmp, capsys: test_eval_fuses_as_the_recipe_says_unless_told_otherwise(
        run, capsys, (), "mean")),
    ("eval_output_unresolved",
     lambda run, tmp, capsys: test_a_path_through_a_link_to_the_run_cannot_name_its_own_evaluation(run, tmp, capsys,
                                                                                                     "eval")),
])
def test_eval_guards_fail_when_broken(mean_fused_run: Path, tmp_path: Path, capsys, monkeypatch, name, guard) -> None:
    """Mutation test: the recipe's fusion replaced by the default, or the report folder compared
    with the run's as written: the guards above fail (on a copy of the run: the broken rule
    writes into its eval/)."""
    from mutations import apply_break

    run = copy_run(mean_fused_run, tmp_path / "copy")
    apply_break(name, monkeypatch.setattr)
    with pytest.raises(AssertionError):
        guard(run, tmp_path, capsys)
