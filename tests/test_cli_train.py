"""Unit guards of ``mmviews train`` (:mod:`mmviews.cli.train`), run by the command's ``main`` in
this process: the option checks and their one-line errors, ``--check``'s report, what a
finished run prints, ``--resume`` of a finished run, of a checkpoint folder and of a run that
stopped before its first checkpoint, the note an error adds about the run folder, and the line
an interrupted run prints with the exact command that resumes it."""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import signal
from pathlib import Path
from typing import Iterator

import pytest
from crafted_files import cli, one_line_error
from test_train_utils import own_accelerate_state, tiny_config, train_in_process, write_recipe

import mmviews.cli.train as train_command
import mmviews.train.distributed as distributed
from mmviews.cli import main
from mmviews.cli.train import (
    _budget_gb,
    _close_process_group,
    _interrupted_line,
    _is_first_process,
    quiet_results_logger,
    resume_command,
)
from mmviews.eval.report import format_metric
from mmviews.run import CONFIG_FILE, list_checkpoints
from mmviews.train.run_folder import claim_run_dir
from mmviews.train.callbacks import TrainCallback
from mmviews.train.interrupt import TrainingInterrupted
from mmviews.eval.summary import RESULTS_LOGGER


def image_recipe(folder: Path, *, epochs: int = 1, tasks: list[str] | None = None, checkpoint_every: int = 2) -> Path:
    """Two views of the synthetic image, a tiny CNN: trains 4 steps in about a second."""
    raw = tiny_config(text=False, num_samples=32, batch_size=8, epochs=epochs, tasks=tasks or [])
    raw["views"], raw["data"]["options"]["modalities"] = [{"modality": "image", "copies": 2}], ["image"]
    del raw["adapters"]["audio"]
    raw["output"].update(checkpoint_every=checkpoint_every, keep_last=2)
    raw["evaluation"]["random_baseline"] = bool(tasks)
    return write_recipe(folder / "recipe.yaml", raw)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A finished tiny run with an evaluation: (run folder, recipe, what the command printed)."""
    folder = tmp_path_factory.mktemp("finished")
    recipe = image_recipe(folder, tasks=["linear:class"])
    run = folder / "run"
    done = train_in_process(str(recipe), "--output", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    return run, recipe, done.stdout


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "two"])
def test_a_memory_budget_must_be_a_positive_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        _budget_gb(text)
    assert str(raised.value) == f"must be a positive number of GiB per device, got {text!r}"


def test_a_memory_budget_takes_any_positive_number() -> None:
    assert _budget_gb("1.5") == 1.5 and _budget_gb("1e-3") == 0.001 and _budget_gb("80") == 80.0


def test_a_bad_memory_budget_is_the_usage_error_of_its_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as shown:
        cli(capsys, "train", "quickstart", "--check", "--memory-budget-gb", "0")
    assert shown.value.code == 2
    assert ("mmviews train: error: argument --memory-budget-gb: must be a positive number of GiB per device, "
            "got '0'") in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["quickstart", "--memory-budget-gb", "4"],
     "--memory-budget-gb applies with --check (mmviews train RECIPE --check --memory-budget-gb G)"),
    (["quickstart", "--resume-ignore-rng"], "--resume-ignore-rng only applies with --resume DIR"),
    (["quickstart", "--reevaluate"], "--reevaluate only applies with --resume DIR"),
    ([], "give a RECIPE (path or name in recipes/) or --resume DIR"),
])
def test_options_that_do_not_go_together_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                                                      message: str) -> None:
    rc, _, err = cli(capsys, "train", *args)
    assert rc == 2 and one_line_error(err) == f"mmviews train: error: {message}"


def test_the_options_defaults() -> None:
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    args = parser.parse_args(["r.yaml", "--set", "a=1", "--set", "b=2", "-o", "out"])
    assert (args.recipe, args.overrides, args.output, args.resume) == ("r.yaml", ["a=1", "b=2"], "out", None)
    assert not (args.overwrite or args.check or args.reevaluate or args.resume_ignore_rng or args.allow_remote_models)
    assert args.memory_budget_gb is None
    assert parser.parse_args([]).overrides == [] and parser.parse_args([]).recipe is None


# --------------------------------------------------------------------------- --check


def test_check_reports_the_views_the_objective_and_the_samples_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = image_recipe(tmp_path)
    run = tmp_path / "run"
    with own_accelerate_state():
        rc, out, err = cli(capsys, "train", str(recipe), "--output", str(run), "--check", "--memory-budget-gb", "64")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{recipe}: OK (2 views: image_0, image_1; objective mv_dhel; 32 training samples)", out
    assert any("64" in line and "GiB" in line for line in lines[1:]), out  # the budget is judged
    assert "warning:" not in out + err, out + err
    assert not run.exists()


def test_check_refuses_a_folder_holding_other_files_after_checking_the_recipe(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    recipe = image_recipe(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    rc, out, err = cli(capsys, "train", str(recipe), "--output", str(tmp_path / "mine"), "--check")
    assert rc == 2 and ": OK (" in out
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert one_line_error(err).startswith(f"mmviews train: error: {tmp_path / 'mine'} is not empty and not an mmviews "
                                          "run folder (it holds notes.txt)")


@pytest.mark.parametrize("check", [["--check"], []])
def test_a_set_that_breaks_the_recipe_is_named_in_the_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            check: list[str]) -> None:
    """The error comes from building the run (a batch larger than the split), with --check and without."""
    recipe = image_recipe(tmp_path)
    with own_accelerate_state():
        rc, _, err = cli(capsys, "train", str(recipe), *check, "--output", str(tmp_path / "run"),
                         "--set", "data.batch_size=64")
    line = one_line_error(err)
    assert rc == 2 and line.startswith("mmviews train: error: --set 'data.batch_size=64': key 'data.batch_size': the "
                                       "'train' split"), line


# --------------------------------------------------------------------------- a run and its resume


def test_a_finished_run_prints_its_folder_loss_headline_and_report(finished_run: tuple[Path, Path, str]) -> None:
    run, _, out = finished_run
    results = json.loads((run / "results.json").read_text())
    lines = out.splitlines()
    (first,) = [line for line in lines if line.startswith("run folder: ")]
    assert first == (f"run folder: {run}  (steps 4, final loss {format_metric(results['final_loss'])}, "
                     f"{results['wall_time_s']:.1f} s)")
    assert "test metrics, trained vs random init:" in lines
    assert any(line.startswith("  test/linear/class/acc  trained ") for line in lines), out
    assert lines[-1] == f"report: {run / 'report.md'}"
    logger = logging.getLogger(RESULTS_LOGGER)  # the command prints the results itself
    assert logger.propagate is False


def test_resuming_a_finished_run_does_nothing_and_says_so(finished_run: tuple[Path, Path, str]) -> None:
    run, _, _ = finished_run
    done = train_in_process("--resume", str(run))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (
        f"mmviews train: {run} has already finished (step 4, results.json written): nothing to do. --reevaluate runs "
        "its evaluation again; --set optimisation.epochs=N (more than 1) trains it longer")
    # from one of its checkpoints: the run folder is the checkpoint's parent, --output may name it
    again = train_in_process("--resume", str(list_checkpoints(run)[-1]), "--output", str(run))
    assert again.returncode == 0 and again.stdout == done.stdout, again.stderr[-2000:]


def test_a_finished_run_names_the_bound_its_recipe_uses(tmp_path: Path) -> None:
    """A recipe bounded by ``optimisation.max_steps`` is told to raise that bound, not epochs; under
    auto-resume (no ``--resume``) the commands are spelled out with ``--resume``."""
    from mmviews.cli.train import _finished_run_options
    from mmviews.config import load_config

    recipe = write_recipe(tmp_path / "r.yaml", tiny_config(text=False))
    run = tmp_path / "my run"
    by_steps = load_config(recipe, ["optimisation.max_steps=7"])
    assert _finished_run_options(run, by_steps, resumed=True) == (
        "--reevaluate runs its evaluation again; --set optimisation.max_steps=N (more than 7) trains it longer")
    resume = f"mmviews train --resume {shlex.quote(str(run))}"
    assert _finished_run_options(run, load_config(recipe), resumed=False) == (
        f"{resume} --reevaluate runs its evaluation again; {resume} --set optimisation.epochs=N (more than 2) "
        "trains it longer")


def test_a_resume_into_another_output_folder_is_refused(finished_run: tuple[Path, Path, str], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    run, _, _ = finished_run
    rc, _, err = cli(capsys, "train", "--resume", str(run), "--output", str(tmp_path / "elsewhere"))
    assert rc == 2
    assert one_line_error(err) == (f"mmviews train: error: --output {tmp_path / 'elsewhere'} differs from the resumed "
                                   f"run folder {run}")


def test_a_new_run_into_a_finished_one_needs_overwrite(finished_run: tuple[Path, Path, str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run, recipe, _ = finished_run
    rc, _, err = cli(capsys, "train", str(recipe), "--output", str(run))
    assert rc == 2 and f"{run} already holds a run; continue it with --resume {run}" in one_line_error(err)
    # a dry run checks the recipe, the data and the memory all the same, and says what training there needs
    rc, out, err = cli(capsys, "train", str(recipe), "--output", str(run), "--check")
    assert rc == 0 and ": OK (" in out and "estimated peak memory" in out and not err, err
    assert out.splitlines()[-1] == (f"note: {run} already holds a run: training there needs --resume {run} "
                                    "(continue it) or --overwrite (replace what it wrote)")


class FailAt(TrainCallback):
    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error = step, error

    def on_step_end(self, state) -> None:
        if state.step == self.step:
            raise self.error


def run_with(monkeypatch: pytest.MonkeyPatch, callback: TrainCallback, *args: str):
    command = train_command.run
    monkeypatch.setattr(train_command, "run", lambda parsed: command(parsed, callback=callback))
    return train_in_process(*args)


def test_an_error_before_the_first_checkpoint_says_the_same_command_starts_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    recipe, run = image_recipe(tmp_path), tmp_path / "run"
    failed = run_with(monkeypatch, FailAt(1, OSError("shard-0.parquet: cannot read")), str(recipe), "--output", str(run))
    assert failed.returncode == 2
    (line,) = failed.stderr.strip().splitlines()
    assert line == (f"mmviews train: error: shard-0.parquet: cannot read; {run} holds no checkpoint: once fixed, "
                    "the same command starts it again there"), line
    # --resume of it starts it again from step 0 with its own config.yaml (here only checked)
    with own_accelerate_state():
        rc, out, err = cli(capsys, "train", "--resume", str(run), "--check")
    assert rc == 0, err
    assert err.splitlines()[0] == (f"mmviews train: warning: {run} has no checkpoint (the run stopped before its first "
                                   "one): starting it again from step 0")
    assert out.splitlines()[0].startswith(f"{run / CONFIG_FILE}: OK (2 views: image_0, image_1;")
    assert out.splitlines()[-1] == (f"run folder: {run}: the run there stopped before its first checkpoint; it starts "
                                    "again from step 0")


def test_ctrl_c_in_the_loop_prints_the_resume_command_and_exits_130(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    recipe, run = image_recipe(tmp_path), tmp_path / "run"
    stopped = run_with(monkeypatch, FailAt(3, KeyboardInterrupt()), str(recipe), "--output", str(run))
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"mmviews train: interrupted by SIGINT; resume from its last complete checkpoint (step 2) with: "
        f"mmviews train --resume {run}")


def test_a_stop_agreed_at_a_checkpoint_exits_with_its_signals_status(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    recipe, run = image_recipe(tmp_path), tmp_path / "run"
    stop = TrainingInterrupted(signal.SIGTERM, step=2, checkpoint=run / "checkpoint-00000002")
    stopped = run_with(monkeypatch, FailAt(2, stop), str(recipe), "--output", str(run))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"mmviews train: stopped by SIGTERM after step 2, checkpoint saved; resume with: mmviews train --resume {run}")


# --------------------------------------------------------------------------- the interrupted line


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed, "_parent_command_line", lambda: ["bash"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def run_without_checkpoint(folder: Path) -> Path:
    """A run folder as a run leaves it before its first checkpoint: its manifest and config.yaml."""
    claim_run_dir(folder)
    (folder / CONFIG_FILE).write_text("name: tiny\n")
    return folder


def test_the_interrupted_line_for_each_way_a_run_stops(tmp_path: Path, no_launcher: None) -> None:
    run = run_without_checkpoint(tmp_path / "my run")
    resume = f"mmviews train --resume '{run}'"
    args = argparse.Namespace(allow_remote_models=False)
    assert _interrupted_line(KeyboardInterrupt(), run, args) == (
        f"interrupted by SIGINT; {run} has no checkpoint yet, start it again with: {resume}")
    assert _interrupted_line(TrainingInterrupted(signal.SIGTERM), run, args) == (
        f"interrupted by SIGTERM; {run} has no checkpoint yet, start it again with: {resume}")
    assert _interrupted_line(TrainingInterrupted(signal.SIGINT, aborted=True), tmp_path / "none", args) == (
        "aborted at once by a second SIGINT before the run folder was written; run the same command again")


def test_the_interrupted_line_names_the_latest_checkpoints_step(tmp_path: Path, no_launcher: None) -> None:
    recipe, run = image_recipe(tmp_path, epochs=2), tmp_path / "run"
    done = train_in_process(str(recipe), "--output", str(run))
    assert done.returncode == 0, done.stderr[-2000:]
    (run / "results.json").unlink()  # as if it had stopped after its last checkpoint
    args = argparse.Namespace(allow_remote_models=True)
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint-00000006", "checkpoint-00000008"]
    assert _interrupted_line(TrainingInterrupted(signal.SIGTERM, aborted=True), run, args) == (
        f"aborted at once by a second SIGTERM; resume from its last complete checkpoint (step 8) with: "
        f"mmviews train --resume {run} --allow-remote-models")
    saved = TrainingInterrupted(signal.SIGINT, step=7, checkpoint=run / "checkpoint-00000007")
    assert _interrupted_line(saved, run, args) == (
        f"stopped by SIGINT after step 7, checkpoint saved; resume with: mmviews train --resume {run} "
        "--allow-remote-models")


def test_the_resume_command_follows_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 no_launcher: None) -> None:
    run = tmp_path / "run"
    assert resume_command(run) == f"mmviews train --resume {run}"
    for world in ("1", "two", ""):
        monkeypatch.setenv("WORLD_SIZE", world)
        assert resume_command(run) == f"mmviews train --resume {run}", world
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: the accelerate line for as many processes
    assert resume_command(run, allow_remote_models=True) == shlex.join(
        ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "-m", "mmviews.cli", "train", "--resume",
         str(run), "--allow-remote-models"])
    launcher = ["/usr/bin/python3", "/venv/bin/accelerate", "launch", "--num_processes", "3", "--cpu", "-m",
                "mmviews.cli", "train", "r.yaml"]
    monkeypatch.setattr(distributed, "_parent_command_line", lambda: launcher)
    assert resume_command(run) == shlex.join(["accelerate", "launch", "--num_processes", "3", "--cpu", "-m",
                                              "mmviews.cli", "train", "--resume", str(run)])


# --------------------------------------------------------------------------- process helpers


def test_only_global_rank_zero_is_the_first_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert _is_first_process()
    monkeypatch.setenv("RANK", "0")
    assert _is_first_process()
    monkeypatch.setenv("RANK", "1")
    assert not _is_first_process()


def test_the_process_group_is_closed_before_exit(tmp_path: Path) -> None:
    import torch.distributed as dist

    _close_process_group()  # none started: nothing to do
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        _close_process_group()
        assert not dist.is_initialized()
        dist.init_process_group("gloo", init_method=(tmp_path / "store2").as_uri(), rank=0, world_size=1)
        _close_process_group(barrier=False)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_results_logger_is_silenced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger(RESULTS_LOGGER)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    quiet_results_logger()
    quiet_results_logger()
    assert logger.propagate is False
    assert [type(h) for h in logger.handlers] == [logging.NullHandler]


# --------------------------------------------------------------------------- what the command prints of a summary


def summary_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                    **summary: object) -> tuple[int, str]:
    """``mmviews train`` with :func:`mmviews.train.train` replaced by one that returns ``summary``
    (the keys train() documents): the exit status and what was printed on stdout (stderr holds
    the health warnings, in the one-line form, and nothing else). What ends in which line (a
    failed run, warnings, data left out) without building a run that fails in each way."""
    recipe = image_recipe(tmp_path)
    full = {"steps": 4, "final_loss": 0.5, "wall_time_s": 3.25, "eval": None, **summary}
    monkeypatch.setattr(train_command, "train", lambda *args, **kwargs: full)
    rc, out, err = cli(capsys, "train", str(recipe), "--output", str(tmp_path / "run"))
    assert err.splitlines() == [f"mmviews train: warning: {w}" for w in full.get("warnings") or []], err
    return rc, out


def test_a_failed_run_says_why_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = summary_printed(tmp_path, monkeypatch, capsys, status="failed", final_loss=None,
                              reason="non-finite values (written as null): final_loss")
    assert rc == 1
    assert out == (f"run folder: {tmp_path / 'run'}  (steps 4, final loss n/a, 3.2 s; FAILED: non-finite values "
                   "(written as null): final_loss)\n")


def test_warnings_and_the_data_left_out_follow_the_run_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = summary_printed(
        tmp_path, monkeypatch, capsys, status="ok", warnings=["collapse: rank 1.0; hint: lower the lr"],
        data_skipped={"train": {"shards": ["a.parquet"]}},
        data_losses={"train": {"split": "train", "skipped_in_training": 3}},
        headline=[{"metric": "test/knn/class/acc", "trained": 0.5, "random_init": None, "chance": None}],
        eval={"test/knn/class/acc": 0.5})
    assert rc == 0
    assert out.splitlines() == [
        f"run folder: {tmp_path / 'run'}  (steps 4, final loss 0.5000, 3.2 s)",
        "test metrics:", "  test/knn/class/acc  trained 0.5000",
        "data left out (data.options.on_error: skip): split 'train': 1 unreadable shard(s) (a.parquet)",
        "data left out: split 'train' (train): 3 dropped from training batches (unreadable when read)",
        f"report: {tmp_path / 'run' / 'report.md'}"]


@pytest.mark.parametrize("status, expected", [("ok", 0), ("failed", 1)])
def test_the_other_processes_print_nothing_and_share_the_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str], status: str,
                                                                 expected: int) -> None:
    monkeypatch.setenv("RANK", "1")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rank0-wrote-this").write_text("")  # rank 0 judges the folder, not this process
    rc, out = summary_printed(tmp_path, monkeypatch, capsys, status=status, reason="r")
    assert (rc, out) == (expected, "")


# --------------------------------------------------------------------------- the options' reference page


def option_rows(parser: argparse.ArgumentParser) -> list[str]:
    """The parser's options as the reference page's table rows (how the option is typed, its help)."""
    import html

    rows = []
    for action in parser._actions:
        if action.dest == "help":
            continue
        value = action.metavar or action.dest.upper()
        typed = (", ".join(action.option_strings) + ("" if action.nargs == 0 else f" {value}")
                 if action.option_strings else f"[{value}]")
        rows.append(f"| `{typed}` | {html.escape(action.help, quote=False)} |")
    return rows


def test_the_options_page_describes_each_option_as_the_help_does() -> None:
    parser = argparse.ArgumentParser(prog="mmviews train")
    train_command.add_arguments(parser)
    page = (Path(__file__).resolve().parents[1] / "docs" / "train-options.md").read_text()
    table = [line for line in page.splitlines() if line.startswith("| `")]
    assert table == option_rows(parser)


# --------------------------------------------------------------------------- --check on a video folder


def test_check_of_a_video_folder_says_what_it_read_and_what_the_data_lacks(video_folder: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The UCF-101-style folder of ``test_train_video_errors``: two known-bad training clips, one
    test clip, and no clip with audio while the recipe has an audio view."""
    from test_train_video_errors import video_recipe

    recipe = write_recipe(tmp_path / "video.yaml", video_recipe(video_folder, "skip"))
    with own_accelerate_state():
        rc, out, err = cli(capsys, "train", str(recipe), "--check", "--output", str(tmp_path / "run"))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == (f"data: ucf101 {video_folder}: 7 clips, split lists from {video_folder / 'ucfTrainTestlist'}")
    assert lines[1] == f"{recipe}: OK (3 views: video_0, video_1, audio_0; objective mv_dhel; 7 training samples)"
    assert "warning" not in out
    warned = [line.removeprefix("mmviews train: ") for line in err.splitlines() if line.startswith("mmviews train: warning: ")]
    assert [line.split(" known to be unreadable")[0] for line in warned[:2]] == [
        "warning: left out 2 sample(s) of split 'train'", "warning: left out 1 sample(s) of split 'test'"]
    assert warned[2] == ("warning: modality 'audio' is absent from every sample of split 'train': its view(s) audio_0 "
                         "are masked 100 % and learn nothing; remove them from the recipe key 'views' (and its "
                         "adapter), or use data that has audio")
    assert len(warned) == 3


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_train_video_errors import folder

    return folder.__wrapped__(tmp_path_factory)


# --------------------------------------------------------------------------- what run() wraps around the command


def test_processes_leave_together_only_after_a_normal_end(finished_run: tuple[Path, Path, str],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """After an error the other processes may be gone: no barrier then (it would hang)."""
    barriers: list[bool] = []
    close = train_command._close_process_group
    monkeypatch.setattr(train_command, "_close_process_group",
                        lambda barrier=True: (barriers.append(barrier), close(barrier=barrier)))
    run, _, _ = finished_run
    assert cli(capsys, "train", "--resume", str(run))[0] == 0  # finished: says so, ends normally
    assert cli(capsys, "train", "--reevaluate")[0] == 2  # an error before any work
    assert barriers == [True, False]


@pytest.fixture
def compiler_log_levels() -> Iterator[None]:
    """The compiler loggers' levels put back after the test (the command sets them process-wide)."""
    from mmviews.train.compiled import COMPILER_LOGGERS

    saved = {name: logging.getLogger(name).level for name in COMPILER_LOGGERS}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("debug", [False, True])
def test_a_compiled_run_says_its_first_step_compiles_and_keeps_the_compilers_log_off_stderr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], compiler_log_levels: None,
        debug: bool) -> None:
    """The note comes before training starts; what torch's compiler logs while the run compiles
    (here the line torch's C++ extension loader gives on a machine without CUDA) reaches stderr
    only with --debug."""
    from mmviews.train.compiled import COMPILE_NOTE, COMPILER_LOGGERS

    recipe = image_recipe(tmp_path)

    def compiling_train(*args: object, **kwargs: object) -> dict:
        print("training starts", flush=True)
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
        return {"steps": 1, "final_loss": 0.5, "wall_time_s": 1.0, "eval": None}

    monkeypatch.setattr(train_command, "train", compiling_train)
    capfd.readouterr()
    rc = main(["train", str(recipe), "--output", str(tmp_path / "run"), "--set", "optimisation.compile=true",
               *(["--debug"] if debug else [])])
    out, err = capfd.readouterr()
    assert rc == 0 and out.splitlines()[:2] == [f"note: {COMPILE_NOTE}", "training starts"], out
    if not debug:
        assert "No CUDA runtime is found" not in err, err
    # (what torch's handler prints goes to the stream it took at import; the level decides it)
    assert all(logging.getLogger(name).isEnabledFor(logging.WARNING) == debug for name in COMPILER_LOGGERS)


@pytest.mark.parametrize("argv, silent", [(["list", "objectives"], "true"), (["list", "objectives", "--debug"], None)])
def test_wandb_s_own_lines_are_off_unless_debug(argv: list[str], silent: str | None, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """W&B reads ``WANDB_SILENT`` when a run starts: the command sets it before any tracker does
    (a value the user set stays)."""
    import os

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    assert main(argv) == 0
    assert os.environ.get("WANDB_SILENT") == silent
    monkeypatch.setenv("WANDB_SILENT", "false")
    assert main(argv) == 0 and os.environ["WANDB_SILENT"] == "false"
