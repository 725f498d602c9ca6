"""Which recipe and run folder ``mmviews train`` takes from its options, what it asks the run
folder's decision (:mod:`mmviews.train.run_folder`) for ``--check``, and ``--check``'s
free-space line (:mod:`mmviews.cli.train`), on fake run folders: nothing is trained or built here
except one tiny run's parts for the space line. The trainings that reach the same code are in
``test_cli_train.py``, ``test_run_folder.py`` and ``test_train_disk_full.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_run_folder import RAW, _run_with_checkpoints
from test_train_utils import tiny_config, write_recipe

from mmviews.cli import command_parser
from mmviews.cli.train import _folder_decision, _intent, _recipe_and_folder, disk_space_line
from mmviews.run import CONFIG_FILE, LOCK_FILE, RunFolderRefused
from mmviews.train.run_folder import CONTINUE, REFUSE, START, Intent


def options(*argv: str):
    """``mmviews train ARGV`` parsed as the command parses it."""
    _, parser = command_parser("train")
    return parser.parse_args([str(a) for a in argv])


@pytest.fixture
def recipe(tmp_path) -> Path:
    return write_recipe(tmp_path / "recipe.yaml", RAW)


# --------------------------------------------------------------------------- recipe and folder


def test_a_new_run_goes_to_output_else_the_recipes_folder_else_runs_and_its_name(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    given, config, run_dir = _recipe_and_folder(options(recipe, "--output", tmp_path / "mine"))
    assert given == recipe and run_dir == tmp_path / "mine" and config.name == RAW["name"]
    _, config, run_dir = _recipe_and_folder(options(recipe, "--set", "output.dir=named-in-the-recipe"))
    assert run_dir == Path("named-in-the-recipe")
    _, config, run_dir = _recipe_and_folder(options(recipe, "--set", "optimisation.epochs=7"))
    assert run_dir == Path("runs") / RAW["name"] and config.optimisation.epochs == 7


def test_resume_takes_the_runs_own_recipe_with_the_sets(tmp_path):
    run = tmp_path / "run"
    checkpoint = _run_with_checkpoints(run, 2, 4, config={**RAW, "name": "the-runs-own"})[-1]
    for resume in (run, checkpoint):  # the run folder, or one of its checkpoints
        recipe, config, run_dir = _recipe_and_folder(options("--resume", resume, "--set", "optimisation.epochs=9",
                                                             "--reevaluate", "--resume-ignore-rng"))
        assert (recipe, run_dir, config.name, config.optimisation.epochs) == (
            run / CONFIG_FILE, run, "the-runs-own", 9)
    # the same folder spelt another way is the run's own --output
    _, _, run_dir = _recipe_and_folder(options("--resume", run, "--output", run / "checkpoints" / ".."))
    assert run_dir == run


def test_resume_with_a_recipe_takes_that_recipe(recipe, tmp_path):
    run = tmp_path / "run"
    _run_with_checkpoints(run, 2)  # no config.yaml: the recipe given is the one compared (later)
    given, config, run_dir = _recipe_and_folder(options(recipe, "--resume", run))
    assert (given, run_dir, config.name) == (recipe, run, RAW["name"])


def test_resume_of_a_folder_without_a_recipe_or_one_elsewhere_is_one_line(tmp_path):
    run = tmp_path / "run"
    _run_with_checkpoints(run, 2)  # no config.yaml
    with pytest.raises(RunFolderRefused) as refused:
        _recipe_and_folder(options("--resume", run))
    assert str(refused.value) == f"{run} is not an mmviews run folder (no {CONFIG_FILE}): nothing to resume"
    _run_with_checkpoints(tmp_path / "ok", 2, config=RAW)
    with pytest.raises(ValueError) as refused:
        _recipe_and_folder(options("--resume", tmp_path / "ok", "--output", tmp_path / "elsewhere"))
    assert str(refused.value) == f"--output {tmp_path / 'elsewhere'} differs from the resumed run folder {tmp_path / 'ok'}"


def test_options_for_check_or_resume_only_are_refused_elsewhere_and_taken_there(recipe, tmp_path):
    for argv, message in (
        ([recipe, "--memory-budget-gb", "4"],
         "--memory-budget-gb applies with --check (mmviews train RECIPE --check --memory-budget-gb G)"),
        ([recipe, "--resume-ignore-rng"], "--resume-ignore-rng only applies with --resume DIR"),
        ([recipe, "--reevaluate"], "--reevaluate only applies with --resume DIR"),
        ([], "give a RECIPE (path or name in recipes/) or --resume DIR"),
    ):
        with pytest.raises(ValueError) as refused:
            _recipe_and_folder(options(*argv))
        assert str(refused.value) == message
    _, _, run_dir = _recipe_and_folder(options(recipe, "--check", "--memory-budget-gb", "4", "-o", tmp_path / "r"))
    assert run_dir == tmp_path / "r"


def test_a_tracker_not_installed_is_refused_with_the_recipe(tmp_path, monkeypatch):
    import mmviews.train.trackers as trackers

    recipe = write_recipe(tmp_path / "tracked.yaml", {**RAW, "output": {**RAW["output"], "trackers": ["mlflow"]}})
    monkeypatch.setattr(trackers, "tracker_installed", lambda name: False)
    with pytest.raises(ValueError) as refused:  # before anything is built
        _recipe_and_folder(options(recipe, "--output", tmp_path / "run"))
    assert str(refused.value).startswith(f"{recipe}: key 'output.trackers': tracker 'mlflow' is not installed")


# --------------------------------------------------------------------------- what --check asks the folder


def test_the_intent_is_the_commands(recipe, tmp_path):
    assert _intent(options(recipe)) == Intent(None, False, True)
    assert _intent(options(recipe, "--overwrite")) == Intent(None, True, True)
    assert _intent(options("--resume", tmp_path / "run")) == Intent(tmp_path / "run", False, False)
    assert _intent(options(recipe, "--resume", "run")) == Intent(Path("run"), False, True)


def test_check_decides_as_the_run_would_and_writes_nothing(recipe, tmp_path):
    run = tmp_path / "run"
    args = options(recipe, "--output", run, "--check")
    new = _folder_decision(args, _recipe_and_folder(args)[1], run)
    assert new.action == START and not run.exists()  # only looked at
    checkpoints = _run_with_checkpoints(run, 2, 4, config=RAW)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    args = options("--resume", run, "--check")
    decided = _folder_decision(args, _recipe_and_folder(args)[1], run)
    assert (decided.action, decided.checkpoint, decided.step) == (CONTINUE, checkpoints[-1], 4)
    refused = _folder_decision(options(recipe, "--output", run, "--check"), _recipe_and_folder(args)[1], run)
    assert refused.action == REFUSE and f"{run} already holds a run" in str(refused.error)
    # a recipe given with --resume is compared with the run's own, as the run compares it
    other = write_recipe(tmp_path / "other.yaml", {**RAW, "seed": RAW.get("seed", 0) + 1})
    args = options(other, "--resume", run, "--check")
    differing = _folder_decision(args, _recipe_and_folder(args)[1], run)
    assert differing.action == REFUSE and "seed" in str(differing.error)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before and not (run / LOCK_FILE).exists()


# --------------------------------------------------------------------------- --check's free-space line


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from mmviews.config import load_config
    from mmviews.train import build_run

    folder = tmp_path_factory.mktemp("space")
    raw = tiny_config(text=False, num_samples=16, batch_size=8)
    raw["output"]["keep_last"] = 2
    return build_run(load_config(write_recipe(folder / "r.yaml", raw)))


def test_check_warns_below_keep_last_plus_one_checkpoints_of_free_space(parts, tmp_path, monkeypatch):
    import mmviews.fileio as fileio

    run = tmp_path / "run"
    free = [0]
    monkeypatch.setattr(fileio, "free_bytes", lambda folder: free[0])
    one = int(re.search(r"about (\d+) bytes each", disk_space_line(parts, run)).group(1))
    assert one > 0
    free[0] = 3 * one  # the two kept and the next one, written before the oldest goes
    assert disk_space_line(parts, run) is None
    free[0] = 3 * one - 1
    assert disk_space_line(parts, run) == (
        f"{run}: {3 * one - 1} bytes free, less than 3 checkpoints (output.keep_last = 2 kept and the next one, "
        f"written before the oldest is deleted; about {one} bytes each, from the parameter and optimiser sizes): the "
        "run would stop on a full disk at its checkpoint 3 or before; free some space or choose another --output")
    monkeypatch.setattr(parts.config.output, "keep_last", 1)
    free[0] = 2 * one
    assert disk_space_line(parts, run) is None
    free[0] = 2 * one - 1
    assert "less than 2 checkpoints (output.keep_last = 1 kept" in disk_space_line(parts, run)
    assert "at its checkpoint 2 or before" in disk_space_line(parts, run)


def test_the_space_line_counts_the_recipes_optimiser_teacher_and_processes(parts, tmp_path, monkeypatch):
    """One checkpoint as the recipe writes it: SGD with momentum keeps one float32 copy of the
    trainable weights, AdamW two (its moments), plain SGD none; an EMA teacher adds a copy of the
    encoder's weights; every process adds its RNG state."""
    import mmviews.fileio as fileio

    monkeypatch.setattr(fileio, "free_bytes", lambda folder: 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def one() -> int:
        return int(re.search(r"about (\d+) bytes each", disk_space_line(parts, tmp_path / "run")).group(1))

    o, encoder = parts.config.optimisation, parts.encoder
    trainable = sum(p.numel() * p.element_size() for p in encoder.parameters() if p.requires_grad)
    weights = sum(t.numel() * t.element_size() for t in [*encoder.parameters(), *encoder.buffers()])
    assert trainable > 0 and not parts.objective.needs_teacher
    monkeypatch.setattr(o, "optimizer", "sgd")
    monkeypatch.setattr(o, "momentum", 0.0)
    plain = one()
    monkeypatch.setattr(o, "momentum", 0.9)
    assert one() - plain == trainable
    monkeypatch.setattr(o, "optimizer", "adamw")
    assert one() - plain == 2 * trainable
    monkeypatch.setattr(o, "optimizer", "sgd")
    monkeypatch.setattr(o, "momentum", 0.0)
    monkeypatch.setattr(parts.config.objective, "ema_teacher", True)
    tensors = len(encoder.state_dict())
    assert weights <= one() - plain <= weights + 1024 * tensors  # the copy, and each of its tensors' header
    monkeypatch.setattr(parts.config.objective, "ema_teacher", False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert plain < one() < plain + 3 * 1024 * 1024  # three more processes' RNG states
