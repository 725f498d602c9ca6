"""``mmviews eval RUN`` (:mod:`mmviews.cli.eval`): its options and their documented defaults, the new
``eval-N`` folder, the rule that refuses the run's own evaluation folders (also through a link or
``..``), the device, and what one evaluation of an untrained run records: the run's settings
(precision, seed, fusion, tasks, plots) unless an option overrides them, the training's number of
views, the report folder recorded as the run's only when it lies in the run, and the run's
random-init baseline beside the numbers only when the evaluation is the run's own."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

# open_clip: the remote-model guards build an open_clip adapter. Imported with the module so that
# a mutation run, which forks a process per mutant from the one that collected the tests, pays
# its import (seconds) once rather than per mutant.
import open_clip  # noqa: F401
import pytest
import torch
from crafted_files import cli, copy_run, one_line_error, untrained_run
from test_eval_rerun import folder_digest
from test_train_utils import tiny_config

from mmviews.cli.eval import add_arguments, check_output, default_output, run_device
from mmviews.run import LOG_FILE, read_manifest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmviews eval")
    add_arguments(parser)
    return parser


def test_options_default_to_the_runs_settings() -> None:
    args = _parser().parse_args(["RUN"])
    assert vars(args) == {"run": "RUN", "tasks": None, "output": None, "fuse": None, "precision": "run",
                          "device": None, "log_csv": None, "seed": None, "overrides": [], "allow_remote_models": False}


@pytest.mark.parametrize("spelling", ["--output", "--out", "-o"])
def test_every_spelling_of_the_output_option(spelling: str) -> None:
    args = _parser().parse_args(["RUN", spelling, "somewhere", "--tasks", "linear:class", "retrieval",
                                 "--fuse", "mean", "--precision", "fp16", "--seed", "7", "--device", "cpu",
                                 "--log-csv", "log.csv", "--allow-remote-models", "--set", "evaluation.plots=false",
                                 "--set", "evaluation.fuse=concat"])
    assert vars(args) == {"run": "RUN", "tasks": ["linear:class", "retrieval"], "output": "somewhere", "fuse": "mean",
                          "precision": "fp16", "device": "cpu", "log_csv": "log.csv", "seed": 7,
                          "overrides": ["evaluation.plots=false", "evaluation.fuse=concat"],
                          "allow_remote_models": True}


@pytest.mark.parametrize("option,value", [("--fuse", "max"), ("--precision", "fp8"), ("--seed", "one")])
def test_a_value_outside_the_choices_is_refused(option: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        _parser().parse_args(["RUN", option, value])
    assert stopped.value.code == 2 and f"argument {option}: invalid" in capsys.readouterr().err


def one_line_help(parser: argparse.ArgumentParser, monkeypatch: pytest.MonkeyPatch) -> str:
    """``--help`` as one line, on a terminal wide enough that argparse wraps nothing."""
    monkeypatch.setenv("COLUMNS", "1000")
    return " ".join(parser.format_help().split())


def test_the_help_states_each_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``mmviews eval --help`` tells a user about the defaults."""
    text = one_line_help(_parser(), monkeypatch)
    for said in ("run run folder or checkpoint folder",
                 "--tasks TASKS [TASKS ...] evaluation tasks, e.g. linear knn msa:mosi retrieval diagnostics "
                 "(default: the run's evaluation.tasks, else 'retrieval diagnostics')",
                 "--output OUTPUT, --out OUTPUT, -o OUTPUT report folder (default: a new <run folder>/eval-N, "
                 "printed; never the run's own eval/) --fuse",
                 "--fuse {concat,mean} how views are fused for probes (default: the run's evaluation.fuse)",
                 "--precision {run,no,bf16,fp16} autocast of the encoder's forward (default 'run': the run's "
                 "optimisation.mixed_precision, as its training-time evaluation; 'no': float32)",
                 "--seed SEED seed of the probes (default: the run's seed)",
                 f"--log-csv LOG_CSV training log with columns step,loss,... (default: the run folder's {LOG_FILE}) "
                 "--seed",
                 "--device DEVICE where the encoder and probes run, e.g. cpu, cuda (default: the run's: CUDA when "
                 "present and the recipe did not set cpu: true)",
                 "--allow-remote-models allow adapters to build open_clip models named 'hf-hub:...' or "
                 "'local-dir:...'",
                 "--set KEY=VALUE override a key of the run's evaluation section, e.g. --set evaluation.plots=false "
                 "(evaluation.* keys only; repeatable; VALUE is YAML)"):
        assert said in text, said


def test_the_new_folder_is_the_first_free_eval_n(tmp_path: Path) -> None:
    assert default_output(tmp_path) == tmp_path / "eval-1"
    (tmp_path / "eval-1").mkdir()
    (tmp_path / "eval-3").mkdir()
    assert default_output(tmp_path) == tmp_path / "eval-2"
    (tmp_path / "eval-2").write_text("a file takes the name too")
    assert default_output(tmp_path) == tmp_path / "eval-4"


@pytest.mark.parametrize("name", ["eval", "eval_random", "eval_epoch_3"])
def test_the_runs_own_evaluations_are_refused_with_the_whole_message(tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    with pytest.raises(ValueError) as refused:
        check_output(out, tmp_path)
    assert str(refused.value) == (
        f"--output {out} is the run's own evaluation (written by mmviews train; report.md links to it): "
        "choose another folder, or leave --output out for a new eval-N folder")


@pytest.mark.parametrize("relative", ["eval-1", "evaluation", "eval_epoch", "my_eval", "sub/eval", "sub/eval_epoch_1"])
def test_other_folders_in_the_run_are_allowed(tmp_path: Path, relative: str) -> None:
    check_output(tmp_path / relative, tmp_path)


def test_a_folder_named_eval_outside_the_run_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    check_output(tmp_path / "eval", tmp_path / "run")


def test_the_runs_device_is_cuda_when_present_unless_the_recipe_says_cpu() -> None:
    assert run_device(True) == "cpu"
    assert run_device(False) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert run_device(False, "cpu") == "cpu" and run_device(True, "cpu:0") == "cpu:0"


def test_where_torch_finds_cuda_the_run_evaluates_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch reports decides (on this CPU machine it is told that CUDA is present)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (run_device(False), run_device(True), run_device(True, "cuda:1")) == ("cuda", "cpu", "cuda:1")


def test_a_requested_device_must_be_one() -> None:
    with pytest.raises(ValueError) as refused:
        run_device(False, "no-such-device")
    assert str(refused.value) == "--device 'no-such-device' is not a device (e.g. cpu, cuda, cuda:1)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_is_refused_where_there_is_none() -> None:
    with pytest.raises(ValueError) as refused:
        run_device(True, "cuda:1")
    assert str(refused.value) == "--device cuda:1: no CUDA device here"


def test_options_are_checked_before_the_run_is_loaded(tmp_path: Path, capsys) -> None:
    """An empty folder is no run, but a bad --output or --device is named first (loading a run
    takes seconds)."""
    rc, _, err = cli(capsys, "eval", str(tmp_path), "--output", str(tmp_path / "eval"))
    assert rc == 2 and f"--output {tmp_path / 'eval'} is the run's own evaluation" in one_line_error(err)
    rc, _, err = cli(capsys, "eval", str(tmp_path), "--device", "nowhere")
    assert rc == 2 and "--device 'nowhere' is not a device" in one_line_error(err)
    rc, _, err = cli(capsys, "eval", str(tmp_path), "--set", "evaluation.plot=false")
    assert rc == 2 and ("--set 'evaluation.plot=false': unknown key 'evaluation.plot' (did you mean 'plots'?)"
                        in one_line_error(err))


@pytest.mark.parametrize("override", ["optimisation.lr=0.1", "data.root=elsewhere", "seed=3", "evaluation={}"])
def test_a_set_outside_the_evaluation_section_is_refused(tmp_path: Path, capsys, override: str) -> None:
    """The encoder and the data are the run's: only how it is evaluated may change (checked
    before the run is loaded: the folder here is empty)."""
    rc, _, err = cli(capsys, "eval", str(tmp_path), "--set", override)
    assert rc == 2
    assert one_line_error(err) == (
        f"mmviews eval: error: --set {override!r}: mmviews eval overrides keys of the run's evaluation section only "
        "(e.g. --set evaluation.plots=false); the encoder, the data and the other settings are the run's")


def test_a_checkpoint_cannot_name_its_runs_own_evaluation(tmp_path: Path, capsys) -> None:
    """The rule looks at the checkpoint's run folder (checked before anything is loaded: the
    checkpoint here is only its marker file)."""
    from mmviews.run import CHECKPOINT_PREFIX, CHECKPOINTS_DIR, TRAIN_STATE_FILE

    checkpoint = tmp_path / CHECKPOINTS_DIR / f"{CHECKPOINT_PREFIX}00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / TRAIN_STATE_FILE).write_text("{}")
    rc, _, err = cli(capsys, "eval", str(checkpoint), "--output", str(tmp_path / "eval"))
    assert rc == 2 and f"--output {tmp_path / 'eval'} is the run's own evaluation" in one_line_error(err)
    assert not (tmp_path / "eval").exists()


def test_a_missing_run_is_named(tmp_path: Path, capsys) -> None:
    rc, _, err = cli(capsys, "eval", str(tmp_path / "gone"))
    assert rc == 2
    assert one_line_error(err) == (f"mmviews eval: error: {tmp_path / 'gone'} does not exist: give a run folder or a "
                                   "checkpoint folder")


# ---------------------------------------------------------------- one evaluation, in this process

RECIPE_SEED = 5
TASKS = ["retrieval"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained run (image, augmented image and audio views for training; 16 samples) whose
    recipe sets seed 5, bf16 autocast, mean fusion and retrieval as its only task, and a training
    log; its ``eval_random/`` is a real evaluation of it with those settings."""
    raw = tiny_config(text=False, num_samples=16, tasks=TASKS)
    raw["seed"] = RECIPE_SEED
    raw["name"] = "guarded"
    raw["optimisation"]["mixed_precision"] = "bf16"
    raw["evaluation"]["fuse"] = "mean"
    run = untrained_run(tmp_path_factory.mktemp("evalguards") / "run", raw)
    (run / LOG_FILE).write_text("step,loss\n1,2.0\n2,1.5\n")
    from mmviews.cli import main

    assert main(["eval", str(run), "--output", str(run.parent / "baseline")]) == 0
    shutil.move(run.parent / "baseline", run / "eval_random")  # where the trainer keeps it
    return run


def _report(out: str) -> tuple[Path, dict]:
    folder = Path(out.rsplit("report written to ", 1)[1].split(" ")[0])
    return folder, json.loads((folder / "metrics.json").read_text())


def test_the_runs_settings_are_used_and_recorded(run: Path, tmp_path: Path, capsys) -> None:
    work = shutil.copytree(run, tmp_path / "run")
    rc, out, err = cli(capsys, "eval", str(work))
    assert rc == 0, err
    folder, report = _report(out)
    assert folder == work / "eval-1"
    meta = report["meta"]
    assert {k: meta[k] for k in ("run", "objective", "name", "num_views", "precision", "seed", "fuse", "tasks")} == {
        "run": str(work), "objective": "mv_dhel", "name": "guarded",
        "num_views": 3,  # image, its augmented copy, audio: the views trained on, not the 2 evaluated
        "precision": "bf16", "seed": RECIPE_SEED, "fuse": "mean", "tasks": "retrieval"}
    assert meta["eval_num_views"] == 2
    assert "training_curves.png" in meta["plots"]  # the run folder's training log, found by itself
    assert "eval-1" in read_manifest(work)["created"]  # part of the run: train --overwrite removes it
    lines = out.splitlines()
    assert lines[-1] == (f"report written to {folder} (precision bf16, seed {RECIPE_SEED}, fuse mean; every metric in "
                         f"{folder / 'summary.md'})")
    # the same evaluation as eval_random's settings: the baseline stands beside the numbers
    assert "test metrics, trained vs random init:" in lines
    # an untrained run retrieves at chance: said on stderr, in the one-line form of mmviews's warnings
    assert any(line.startswith("mmviews eval: warning: ") for line in err.splitlines()), err


@pytest.mark.parametrize("option", [("--seed", "6"), ("--fuse", "concat"), ("--tasks", "knn:class", "retrieval"),
                                    ("--set", "evaluation.fuse=concat"),
                                    ("--set", "evaluation.tasks=[knn:class, retrieval]"),
                                    ("--set", "evaluation.views=[{modality: audio}, {modality: image}]")])
def test_the_baseline_is_left_out_when_the_evaluation_differs(run: Path, tmp_path: Path, capsys, option) -> None:
    rc, out, err = cli(capsys, "eval", str(run), "--output", str(tmp_path / "out"), *option)
    assert rc == 0, err
    assert "test metrics:" in out.splitlines() and "random init" not in out
    # the health checks still judge the numbers (an untrained encoder retrieves at chance)
    assert any(line.startswith("mmviews eval: warning: retrieval at chance") for line in err.splitlines()), err


def test_a_set_overrides_the_runs_evaluation_and_flags_win_over_it(run: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = cli(capsys, "eval", str(run), "--output", str(tmp_path / "set"), "--set", "evaluation.fuse=concat",
                       "--set", "evaluation.tasks=[knn:class]", "--set", "evaluation.plots=false")
    assert rc == 0, err
    _, report = _report(out)
    assert (report["meta"]["fuse"], report["meta"]["tasks"], report["meta"]["plots"]) == ("concat", "knn:class", [])
    rc, out, err = cli(capsys, "eval", str(run), "--output", str(tmp_path / "flags"), "--set", "evaluation.fuse=concat",
                       "--fuse", "mean", "--set", "evaluation.tasks=[knn:class]", "--tasks", "retrieval")
    assert rc == 0, err
    _, report = _report(out)
    assert (report["meta"]["fuse"], report["meta"]["tasks"]) == ("mean", "retrieval")
    # with the run's tasks, fusion and seed, the plots alone changed: the baseline still stands beside the numbers
    assert "test metrics, trained vs random init:" in out.splitlines()
    # the evaluation views are the loaders' own: an override of them builds the loaders again
    rc, out, err = cli(capsys, "eval", str(run), "--output", str(tmp_path / "views"), "--tasks", "knn:class",
                       "--set", "evaluation.views=[{modality: audio}]")
    assert rc == 0, err
    assert _report(out)[1]["meta"]["eval_num_views"] == 1  # the run's evaluation views are 2 (image, audio)


def test_a_sets_bad_value_is_named_by_the_set(run: Path, tmp_path: Path, capsys) -> None:
    rc, _, err = cli(capsys, "eval", str(run), "--output", str(tmp_path / "out"), "--set", "evaluation.fuse=max")
    line = one_line_error(err)
    assert rc == 2 and line.startswith("mmviews eval: error: --set 'evaluation.fuse=max': key 'evaluation.fuse'"), line
    assert not (tmp_path / "out").exists()


def test_options_override_the_runs_settings(run: Path, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "elsewhere"
    before = set(read_manifest(run)["created"])
    rc, out, err = cli(capsys, "eval", str(run), "--output", str(out_dir), "--precision", "no", "--seed", "9",
                       "--fuse", "concat", "--tasks", "knn:class", "--log-csv", str(tmp_path / "no-log.csv"))
    assert rc == 0, err
    folder, report = _report(out)
    assert folder == out_dir
    meta = report["meta"]
    assert (meta["precision"], meta["seed"], meta["fuse"], meta["tasks"]) == ("no", 9, "concat", "knn:class")
    assert f"report written to {out_dir} (precision float32, seed 9, fuse concat;" in out  # not "precision no"
    assert "test/knn/class/top1" in report["metrics"] and not any("retrieval" in key for key in report["metrics"])
    assert meta["n_val"] > 0  # the validation split was read (it picks the probes' settings)
    assert f"No training log at {tmp_path / 'no-log.csv'}" in (folder / "summary.md").read_text()
    assert set(read_manifest(run)["created"]) == before  # a folder outside the run is not the run's


def test_a_label_the_data_lacks_is_refused_before_any_split_is_embedded(run: Path, tmp_path: Path, capsys,
                                                                          monkeypatch) -> None:
    """`mmviews eval RUN --tasks knn:colour` embedded every split before saying the
    label does not exist."""
    import mmviews.eval.evaluate as evaluate

    embedded = []
    monkeypatch.setattr(evaluate, "extract_embeddings", lambda *a, **k: embedded.append(k["desc"]))
    rc, _, err = cli(capsys, "eval", str(run), "--output", str(tmp_path / "out"), "--tasks", "retrieval", "knn:colour")
    assert rc == 2 and embedded == []
    assert one_line_error(err) == ("mmviews eval: error: task 'knn:colour' reads the label 'colour', which the samples "
                                   "of the train split do not carry; they carry ['class', 'content_u', 'content_v', "
                                   "'sentiment']")
    rc, _, err = cli(capsys, "eval", str(run), "--output", str(tmp_path / "out"), "--tasks", "linear:clas")
    assert rc == 2 and embedded == [] and "reads the label 'clas', which the samples of the train split do not carry " \
        "(did you mean 'class'?)" in one_line_error(err)


def test_without_tasks_in_the_recipe_retrieval_and_diagnostics_are_evaluated(tmp_path: Path, capsys) -> None:
    raw = tiny_config(text=False, num_samples=16, tasks=[])
    run = untrained_run(tmp_path / "run", raw)
    rc, out, err = cli(capsys, "eval", str(run), "--precision", "no")
    assert rc == 0, err
    _, report = _report(out)
    assert report["meta"]["tasks"] == "retrieval, diagnostics"
    assert "No training log" not in (run / "eval-1" / "summary.md").read_text()  # none asked for, none missing


def remote_model_run(folder: Path) -> tuple[Path, Path]:
    """``(run, missing)``: an untrained run whose saved image adapter names an open_clip model
    in the folder ``missing`` (``local-dir:``, outside the recipe; the folder does not exist)."""
    run = untrained_run(folder / "run", tiny_config(text=False, num_samples=8))
    missing = folder / "no_such_model_dir"
    (run / "encoder" / "image" / "config.json").write_text(
        json.dumps({"type": "open_clip", "model": f"local-dir:{missing}", "embed_dim": 16}))
    return run, missing


def check_remote_models_need_the_flag(capsys, command: str, run: Path, missing: Path, *args: str) -> None:
    """Without ``--allow-remote-models`` the model is refused, naming the file and the flag; with
    it, the name reaches open_clip (which finds no such folder)."""
    rc, _, err = cli(capsys, command, str(run), *args)
    assert rc == 2 and one_line_error(err) == (
        f"mmviews {command}: error: {run / 'encoder' / 'image' / 'config.json'}: model='local-dir:{missing}' loads a "
        "model configuration and weights from outside the recipe; refused unless asked for on the command line "
        "(--allow-remote-models)")
    rc, _, err = cli(capsys, command, str(run), *args, "--allow-remote-models")
    line = one_line_error(err)
    assert rc == 2 and "--allow-remote-models" not in line and str(missing) in line, line


def test_a_model_from_outside_the_recipe_needs_the_flag(tmp_path: Path, capsys) -> None:
    run, missing = remote_model_run(tmp_path)
    check_remote_models_need_the_flag(capsys, "eval", run, missing)


def test_the_encoder_stays_on_the_cpu_asked_for_where_cuda_is_present(run: Path, tmp_path: Path, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cpu``, or the recipe's ``cpu: true``, keeps the evaluation on the CPU although
    torch reports CUDA (told so here: this machine has none, so a move to CUDA would fail)."""
    import yaml

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc, _, err = cli(capsys, "eval", str(run), "--device", "cpu", "--output", str(tmp_path / "a"))
    assert rc == 0, err
    on_cpu = shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("eval*"))
    recipe = yaml.safe_load((on_cpu / "config.yaml").read_text())
    recipe["cpu"] = True
    (on_cpu / "config.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    rc, _, err = cli(capsys, "eval", str(on_cpu), "--output", str(tmp_path / "b"))
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------
# End to end on an untrained run: the fusion, the plots and the report folder's place
# ---------------------------------------------------------------------------------------------
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
