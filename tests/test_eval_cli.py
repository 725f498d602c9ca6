"""``mmviews eval RUN``: the recipe's ``evaluation.fuse`` is the fusion the probes use unless
``--fuse`` overrides it, and the rule about report folders looks at where a folder really is: a
path through a link to the run, or with ``..`` in it, that names the run's own ``eval/`` is
refused, and a new folder inside the run reached that way is recorded as the run's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from crafted_files import cli, copy_run, one_line_error, untrained_run
from test_eval_rerun import folder_digest
from test_train_utils import tiny_config

from mmviews.run import read_manifest


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
