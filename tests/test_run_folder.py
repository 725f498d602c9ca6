"""What a command does with a run folder (:mod:`mmviews.train.run_folder`), one command at a
time (:class:`mmviews.run.RunFolderLock`), and error lines whose hints agree with the error.

- A recipe given with ``--resume`` that is not the run's own is refused naming the keys, and the
  folder is left as it was (a finished run resumed with the recipe it was started from, less
  its ``--set``); the run's own recipe, or ``--set`` alone, continues.
- Two real commands on one folder: while a run holds it (held in its first epoch without
  ``auto_resume``, or while its checkpoint is in its temporary folder with it), a second
  ``train`` (the same command), ``--resume``, ``--overwrite``, ``eval`` and ``--check`` are each
  refused in one line naming the process and host; the live run's files are untouched; once the
  first is SIGKILLed the same command continues (the kernel released the lock).
- ``--resume`` of a run whose newest ``train_state.json`` is corrupt names the intact checkpoint
  before it (and the command continues from it); ``--resume RUN/checkpoints`` and
  ``RUN/encoder`` name the run folder; each line is also checked for what it must not say.
- ``--check`` refuses what the run refuses, in the same line (``--overwrite`` with
  ``output.auto_resume``), and says what the run would do with its folder.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from crafted_files import cli, copy_run, one_line_error
from test_train_utils import env, own_accelerate_state, started, tiny_config, train_in_process, wait_for_file, write_recipe

from mmviews.config import load_config
from mmviews.run import LOCK_FILE, FolderInUseError, RunFolderLock, list_checkpoints, lock_holder
from mmviews.train.run_folder import CONTINUE, REFUSE, REPLACE, START, Intent, RunFolder, claim_run_dir

SLOW_TRAIN = Path(__file__).resolve().parent / "slow_train.py"


def _files(run: Path) -> dict[Path, tuple[int, bytes]]:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- one decision


def test_a_recipe_given_with_resume_must_be_the_runs_own(tiny_run, tmp_path, capsys):
    """``mmviews train RECIPE --resume RUN`` with the recipe the run was started
    from but without its ``--set`` is refused naming the key, before anything in the folder
    changes (``config.yaml`` above all); the run's own recipe continues it."""
    run = copy_run(tiny_run, tmp_path / "run", unfinished=True)
    shutil.rmtree(run / "encoder")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    started_from = write_recipe(tmp_path / "recipe.yaml", dict(saved, optimisation={**saved["optimisation"],
                                                                                     "epochs": 6}))
    before = _files(run)
    with own_accelerate_state():
        rc, out, err = cli(capsys, "train", str(started_from), "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2 and line.startswith(f"mmviews train: error: --resume: the recipe differs from the one {run} was "
                                       "started with") and " in optimisation.epochs;" in line, line
    assert f"--resume {run} --set KEY=VALUE" in line and "resumed" not in out + err and "latest checkpoint" not in line
    assert _files(run) == before and not (run / LOCK_FILE).exists()  # not a file touched; the lock gone with the command
    # --check says the same, as the run would
    with own_accelerate_state():
        rc, _, err = cli(capsys, "train", str(started_from), "--resume", str(run), "--check")
    assert rc == 2 and one_line_error(err) == line
    # the run's own recipe continues it; --set alone changes it on purpose, config.yaml rewritten after the load
    own = write_recipe(tmp_path / "own.yaml", saved)
    decision = RunFolder(run).decide(load_config(own), Intent(resume=run), act=False)
    assert (decision.action, decision.checkpoint) == (CONTINUE, list_checkpoints(run)[-1])
    r = train_in_process("--resume", str(run), "--set", "optimisation.epochs=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"mmviews train: warning: resumed from {decision.checkpoint} at step 4 of 6" in r.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["optimisation"]["epochs"] == 3


def test_the_decision_for_each_folder_state(tmp_path):
    config = load_config(write_recipe(tmp_path / "a.yaml", tiny_config(text=False)))
    auto = load_config(write_recipe(tmp_path / "b.yaml", tiny_config(text=False)), ["output.auto_resume=true"])
    new = tmp_path / "new"
    decided = RunFolder(new).decide(config, Intent(), act=False)
    assert (decided.action, decided.again, decided.line()) == (START, False, f"{new}: a new run starts there")
    assert not new.exists()
    for intent, cfg, words in ((Intent(overwrite=True), auto, "output.auto_resume continues it"),
                               (Intent(resume=new, overwrite=True), config, "--resume continues it")):
        decided = RunFolder(new).decide(cfg, intent, act=False)
        assert decided.action == REFUSE and str(decided.error) == f"--overwrite replaces the run, {words}: choose one"
    assert str(_look(new, config, resume=new).error) == (
        f"{new} is not an mmviews run folder (no .mmviews-run.json or config.yaml): nothing to resume")
    stopped = tmp_path / "stopped"
    claim_run_dir(stopped)
    (stopped / "metrics.csv").write_text("step,loss\n")
    for intent in (Intent(), Intent(resume=stopped, recipe_given=False)):
        decided = RunFolder(stopped).decide(config, intent, act=False)
        assert (decided.action, decided.again, decided.run_dir) == (START, True, stopped), intent
        assert decided.notes == [f"{stopped} has no checkpoint (the run stopped before its first one): starting it "
                                 "again from step 0"]
    (stopped / "results.json").write_text("{}")
    assert RunFolder(stopped).decide(config, Intent(overwrite=True), act=False).action == REPLACE
    assert _look(stopped, config, overwrite=True).line().startswith(f"{stopped}: --overwrite replaces")
    assert RunFolder(stopped).decide(config, Intent(), act=False).action == REFUSE
    assert "no complete checkpoint in" in str(RunFolder(stopped).decide(config, Intent(resume=stopped), act=False).error)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert str(_look(afile, config).error) == f"{afile} is a file, not a run folder: choose another --output"
    for intent, cfg in ((Intent(overwrite=True), auto), (Intent(resume=new, overwrite=True), config)):
        assert _look(new, cfg, **vars(intent)).action == REFUSE
    nested = tmp_path / "a" / "b" / "c"  # acting creates a new folder with its parents, for the lock
    made = RunFolder(nested)
    assert made.decide(config, Intent()).action == START and (nested / LOCK_FILE).is_file()
    made.release()
    assert RunFolder(nested, "mmviews eval").lock.command == "mmviews eval"
    # acting takes the lock (and creates the new folder for it); a second decision in this process is refused
    first = RunFolder(new)
    assert first.decide(config, Intent()).action == START and (new / LOCK_FILE).is_file()
    held = RunFolder(new).decide(config, Intent())
    assert held.action == REFUSE and isinstance(held.error, FolderInUseError) and held.run_dir == new
    assert f"process {os.getpid()} on host {socket.gethostname()}" in str(held.error)
    first.release()
    assert not (new / LOCK_FILE).exists() and lock_holder(new) is None


def test_a_stale_lock_file_is_taken_over(tmp_path):
    """A killed holder's lock file stays; nobody holds its lock, so the next command takes it,
    and a folder holding only that file counts as empty."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text('{"pid": 1, "host": "elsewhere", "command": "mmviews train"}\n')
    assert lock_holder(run) is None
    config = load_config(write_recipe(tmp_path / "a.yaml", tiny_config(text=False)))
    folder = RunFolder(run)
    assert folder.decide(config, Intent()).action == START
    assert f'"pid": {os.getpid()}' in (run / LOCK_FILE).read_text()
    folder.release()
    with RunFolderLock(run, "mmviews eval") as lock:
        assert lock.held and "(mmviews eval, this process)" in lock_holder(run)


# --------------------------------------------------------------------------- one command per folder


@pytest.mark.parametrize("auto_resume", [False, True], ids=["plain", "auto_resume"])
def test_a_second_command_on_a_held_folder_is_refused(tmp_path, capsys, auto_resume):
    """Two real commands on one folder. Without ``auto_resume`` the first run is held
    after step 1, before its first checkpoint (a second command used to start it over in place,
    replacing its ``metrics.csv``); with it, while its checkpoint of step 2 is in its temporary
    folder (a second copy used to remove it as a left-over and resume from the one before)."""
    raw = tiny_config(num_samples=32, batch_size=16, epochs=2, text=False)
    raw["output"].update(checkpoint_every=1, keep_last=3, auto_resume=auto_resume)
    recipe, run, held = write_recipe(tmp_path / "tiny.yaml", raw), tmp_path / "run", tmp_path / "held"
    hold = (["--hold-after-checkpoint", "2", "--checkpoint-hold-marker", str(held)] if auto_resume
            else ["--hold-after-step", "1", "--hold-marker", str(held)])
    command = [sys.executable, str(SLOW_TRAIN), *hold, "--", str(recipe), "--output", str(run)]
    with started(command, env=env()) as first:
        wait_for_file(first, held, "the first run's hold")
        before = _files(run)
        holder = f"process {first.pid} on host {socket.gethostname()} (mmviews train)"
        refusal = (f"mmviews train: error: {run} is in use by {holder}: one command at a time uses a run folder; wait "
                   "for it to end (or stop it), or choose another --output")
        attempts = [["train", str(recipe), "--output", str(run)], ["train", "--resume", str(run)],
                    ["train", str(recipe), "--output", str(run), "--check"]]
        if not auto_resume:
            attempts.append(["train", str(recipe), "--output", str(run), "--overwrite"])
        for args in attempts:
            with own_accelerate_state():
                rc, out, err = cli(capsys, *args)
            assert rc == 2 and one_line_error(err) == refusal, (args, err)
            assert "resumed" not in out + err and "removed" not in err and "starting it again" not in err, args
        rc, _, err = cli(capsys, "eval", str(run))  # an evaluation that writes into the run
        assert rc == 2 and one_line_error(err) == refusal.replace("mmviews train:", "mmviews eval:"), err
        assert _files(run) == before, "a refused command changed the live run's folder"
        if auto_resume:
            assert (run / "checkpoints" / ".tmp-checkpoint-00000002" / "train_state.json").is_file()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # the kernel released the lock with the process: the same command goes on
    r = train_in_process(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    if auto_resume:
        assert f"resumed from {run / 'checkpoints' / 'checkpoint-00000001'} at step 1 of 4" in r.stderr
    else:
        assert "has no checkpoint (the run stopped before its first one): starting it again" in r.stderr
    assert [c.name for c in list_checkpoints(run)][-1] == "checkpoint-00000004"
    assert not (run / LOCK_FILE).exists()


# --------------------------------------------------------------------------- hints that agree with the error


def test_a_corrupt_newest_train_state_names_the_intact_checkpoint_before_it(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "run", unfinished=True)
    shutil.rmtree(run / "encoder")
    first, last = list_checkpoints(run)
    (last / "train_state.json").write_text("{")
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2 and str(last / "train_state.json") in line, line
    assert line.endswith(f"the newest intact checkpoint before it is {first} (step 2): continue from it with "
                         f"mmviews train --resume {first}"), line
    assert "checkpoints/checkpoint-N" not in line and "latest checkpoint is kept" not in line, line
    # the same with the checkpoint folder itself given
    rc, _, err = cli(capsys, "train", "--resume", str(last))
    assert rc == 2 and f"mmviews train --resume {first}" in one_line_error(err)
    # the command it names continues from there
    r = train_in_process("--resume", str(first))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"mmviews train: warning: resumed from {first} at step 2 of 4" in r.stderr


def test_no_intact_checkpoint_before_it_says_only_overwrite_helps(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "run", unfinished=True)
    first, last = list_checkpoints(run)
    (last / "train_state.json").write_text("{")
    (first / "optimizer.bin").write_bytes(b"x")
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2 and line.endswith(f"no earlier checkpoint of {run} is intact, nothing to continue from: "
                                     "--overwrite starts the run again"), line
    assert "--resume" not in line and "latest checkpoint is kept" not in line and "same command" not in line, line


def test_a_damaged_file_of_the_resumed_checkpoint_names_the_one_before(tiny_run, tmp_path, capsys):
    """A file that fails its recorded checksum while the checkpoint is loaded: the line names it
    and the intact checkpoint to pass instead, not "the latest checkpoint is kept"."""
    run = copy_run(tiny_run, tmp_path / "run", unfinished=True)
    first, last = list_checkpoints(run)
    (last / "optimizer.bin").write_bytes(b"x")
    with own_accelerate_state():
        rc, _, err = cli(capsys, "train", "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2 and str(last / "optimizer.bin") in line and f"mmviews train --resume {first}" in line, line
    assert "latest checkpoint is kept" not in line and not re.search(rf"--resume {re.escape(str(run))}(;|$| )", line), line


@pytest.mark.parametrize("inside", ["checkpoints", "encoder"])
def test_resume_of_a_folder_inside_a_run_names_the_run(tiny_run, tmp_path, capsys, inside):
    run = copy_run(tiny_run, tmp_path / "run")
    rc, _, err = cli(capsys, "train", "--resume", str(run / inside))
    line = one_line_error(err)
    assert rc == 2 and f"(--resume {run}" in line and f"of the run {run}" in line, line
    assert "checkpoints/checkpoints" not in line and "expected" not in line, line


# --------------------------------------------------------------------------- --check decides as the run does


def test_check_refuses_overwrite_with_auto_resume_as_the_run_does(tmp_path, capsys):
    """``--overwrite --set output.auto_resume=true`` is refused by ``--check``
    in the run's own line (it used to say OK)."""
    recipe, run = write_recipe(tmp_path / "tiny.yaml", tiny_config(text=False)), tmp_path / "run"
    args = ["train", str(recipe), "--output", str(run), "--overwrite", "--set", "output.auto_resume=true"]
    with own_accelerate_state():
        rc, _, err = cli(capsys, *args)
    refused = one_line_error(err)
    assert rc == 2 and refused == ("mmviews train: error: --overwrite replaces the run, output.auto_resume continues "
                                   "it: choose one")
    with own_accelerate_state():
        rc, out, err = cli(capsys, *args, "--check")
    assert rc == 2 and one_line_error(err) == refused and "run folder:" not in out
    assert not run.exists()


def test_check_says_what_the_run_would_do_with_its_folder(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "run", unfinished=True)
    shutil.rmtree(run / "encoder")
    last = list_checkpoints(run)[-1]
    (last / "model.safetensors").write_bytes(b"x")
    before = _files(run)
    with own_accelerate_state():
        rc, out, err = cli(capsys, "train", str(run / "config.yaml"), "--output", str(run), "--set",
                           "output.auto_resume=true", "--check")
    first = list_checkpoints(run)[0]
    assert rc == 0, err
    assert out.splitlines()[-1] == f"run folder: {run}: the run continues from {first} (step 2)"
    assert f"mmviews train: warning: skipping the damaged checkpoint {last}: " in err
    assert _files(run) == before and not (run / LOCK_FILE).exists()  # --check writes nothing


# --------------------------------------------------------------------------- units (no training)


def _run_with_checkpoints(run: Path, *steps: int, config: dict[str, Any] | None = None) -> list[Path]:
    """An mmviews run folder (manifest, ``config.yaml``) with fake checkpoints of ``steps``."""
    from test_train_auto_resume import _fake_checkpoint

    claim_run_dir(run)
    if config is not None:
        write_recipe(run / "config.yaml", config)
    return [_fake_checkpoint(run, step) for step in steps]


def _look(run: Path, config: Any, **intent: Any) -> Any:
    decided = RunFolder(run).decide(config, Intent(**intent), act=False)
    assert decided.run_dir == run, decided
    return decided


RAW = tiny_config(text=False)


@pytest.fixture
def config(tmp_path) -> Any:
    return load_config(write_recipe(tmp_path / "recipe.yaml", RAW))


def test_decision_lines_and_their_plain_data(tmp_path):
    from mmviews.run import RunExistsError, RunFolderRefused
    from mmviews.train.run_folder import Decision

    run, checkpoint = tmp_path / "run", tmp_path / "run" / "checkpoints" / "checkpoint-00000003"
    assert Decision(CONTINUE, run, checkpoint, 3).line() == f"{run}: the run continues from {checkpoint} (step 3)"
    assert Decision(REPLACE, run).line() == f"{run}: --overwrite replaces the run there (only what it wrote is removed)"
    assert Decision(START, run, again=True).line() == (f"{run}: the run there stopped before its first checkpoint; it "
                                                        "starts again from step 0")
    refused = Decision(REFUSE, run, error=RunExistsError("no"))
    assert refused.line() == "no"
    with pytest.raises(RunExistsError, match="^no$"):
        refused.raise_if_refused()
    Decision(START, run).raise_if_refused()  # nothing to raise
    for decision in (Decision(CONTINUE, run, checkpoint, 3, notes=["a", "b"]), Decision(START, run, again=True),
                     refused, Decision(REFUSE, run, error=FolderInUseError("held")),
                     Decision(REFUSE, run, error=RunFolderRefused("plain"))):
        back = Decision.from_data(decision.to_data())
        assert (back.action, back.run_dir, back.checkpoint, back.step, back.again, back.notes) == (
            decision.action, decision.run_dir, decision.checkpoint, decision.step, decision.again, decision.notes)
        assert type(back.error) is type(decision.error) and str(back.error) == str(decision.error)
    unknown = Decision.from_data(("refuse", str(run), None, None, False, [], ("SomethingElse", "why")))
    assert type(unknown.error) is RunFolderRefused and str(unknown.error) == "why"


def test_folders_that_are_not_runs_are_refused_before_any_lock(tmp_path, config):
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("a", "b", "c", "d", "e", "f"):
        (mine / name).write_text("mine")
    for act in (False, True):
        decided = RunFolder(mine).decide(config, Intent(overwrite=True), act=act)
        assert str(decided.error) == (f"{mine} is not empty and not an mmviews run folder (it holds a, b, c, d, e, ...); "
                                      "mmviews writes only into a new or empty folder or one of its own runs: choose "
                                      "another --output")
        assert not (mine / LOCK_FILE).exists()  # nothing written into a folder of the user's
    (mine / "f").unlink()
    assert "(it holds a, b, c, d, e);" in str(_look(mine, config))
    unwritable = Path("/proc/mmviews-no-such-run")  # no file can be created in /proc, not even by root
    for act in (False, True):
        decided = RunFolder(unwritable).decide(config, Intent(), act=act)
        assert decided.run_dir == unwritable and decided.action == REFUSE and str(decided.error).startswith(f"cannot write {unwritable}: /proc refuses")


def test_every_branch_of_the_decision(tmp_path, config):
    from mmviews.run import RunExistsError

    run = tmp_path / "run"
    first, second = _run_with_checkpoints(run, 2, 4, config=RAW)
    assert _look(run, config).action == REFUSE and isinstance(_look(run, config).error, RunExistsError)
    assert str(_look(run, config).error) == (f"{run} already holds a run; continue it with --resume {run}, or choose "
                                             "another --output (or --overwrite to replace what that run wrote)")
    assert _look(run, config, overwrite=True).action == REPLACE
    for resume, expected in ((run, second), (first, first), (second, second)):
        decided = _look(run, config, resume=resume)
        assert (decided.action, decided.checkpoint, decided.step) == (CONTINUE, expected, int(expected.name[-2:])), resume
    other = load_config(write_recipe(tmp_path / "other.yaml", dict(RAW, seed=5)))
    assert _look(run, other, resume=run, recipe_given=False).action == CONTINUE  # --resume RUN --set: on purpose
    decided = _look(run, other, resume=run)
    assert str(decided.error) == (f"--resume: the recipe differs from the one {run} was started with "
                                  f"({run / 'config.yaml'}) in seed; leave the recipe out to continue with the run's "
                                  f"own (--resume {run}), --resume {run} --set KEY=VALUE to change it on purpose, or "
                                  "another --output to start a new run")
    auto = load_config(write_recipe(tmp_path / "auto.yaml", RAW), ["output.auto_resume=true"])
    decided = _look(run, auto)  # output.* may differ
    assert (decided.action, decided.checkpoint, decided.notes) == (CONTINUE, second, [])
    auto_other = load_config(write_recipe(tmp_path / "auto2.yaml", dict(RAW, seed=5)), ["output.auto_resume=true"])
    assert str(_look(run, auto_other).error).startswith("output.auto_resume: the recipe differs from the one")
    assert "; use that recipe to continue the run, --resume" in str(_look(run, auto_other).error)
    # every differing key named up to eight, then counted
    many = dict(RAW, seed=9, data={**RAW["data"], "batch_size": 4, "eval_batch_size": 8},
                optimisation={**RAW["optimisation"], "lr": 1.0, "epochs": 9, "warmup_steps": 0, "max_grad_norm": 1.0,
                              "optimizer": "sgd"})
    message = str(_look(run, load_config(write_recipe(tmp_path / "many.yaml", many)), resume=run).error)
    assert " in data.batch_size, data.eval_batch_size, optimisation.epochs, optimisation.lr, optimisation.max_grad_norm, " \
           "optimisation.optimizer, optimisation.warmup_steps, seed;" in message
    many["encoder"] = {"embed_dim": 8}
    message = str(_look(run, load_config(write_recipe(tmp_path / "many.yaml", many)), resume=run).error)
    assert "optimisation.optimizer, optimisation.warmup_steps and 1 more;" in message
    # without a config.yaml there is nothing to compare with
    (run / "config.yaml").unlink()
    assert _look(run, other, resume=run).action == CONTINUE and _look(run, auto_other).action == CONTINUE
    # a run with results but no checkpoint: nothing to continue from
    results_only = tmp_path / "results_only"
    claim_run_dir(results_only)
    (results_only / "results.json").write_text("{}")
    assert str(_look(results_only, config, resume=results_only).error) == (
        f"no complete checkpoint in {results_only} (expected {results_only}/checkpoints/checkpoint-N): nothing to "
        "continue from; --overwrite starts the run again")


def test_resume_checkpoints_that_cannot_be_read(tmp_path, config):
    from mmviews.train.run_folder import add_damaged_checkpoint_hint, earlier_intact_hint, HINTED

    run = tmp_path / "run"
    one, two, three = _run_with_checkpoints(run, 1, 2, 3, config=RAW)
    (three / "train_state.json").write_text("[]")
    for resume in (run, three):
        decided = _look(run, config, resume=resume)
        assert decided.action == REFUSE and str(decided.error).startswith(f"{three / 'train_state.json'}: ")
        assert str(decided.error).endswith(f"; the newest intact checkpoint before it is {two} (step 2): continue "
                                           f"from it with mmviews train --resume {two}")
        assert "resume from an earlier one" not in str(decided.error)  # train_state.json's own generic hint, cut
    assert _look(run, config, resume=two).checkpoint == two  # an intact one given itself
    best = shutil.copytree(three, run / "checkpoints" / "best")  # a checkpoint folder of the user's name
    decided = _look(run, config, resume=best)
    assert str(decided.error).endswith(f"no earlier checkpoint of {run} is intact, nothing to continue from: "
                                       "--overwrite starts the run again")  # no step in its name: none is before it
    shutil.rmtree(best)
    (two / "model.safetensors").write_bytes(b"")
    assert earlier_intact_hint(three, run).startswith(f"the newest intact checkpoint before it is {one} (step 1)")
    assert earlier_intact_hint(two, run).startswith(f"the newest intact checkpoint before it is {one} (step 1)")
    assert earlier_intact_hint(one, run) == (f"no earlier checkpoint of {run} is intact, nothing to continue from: "
                                             "--overwrite starts the run again")
    error = ValueError("x.bin: truncated")
    add_damaged_checkpoint_hint(error, two)
    assert error.__notes__ == [earlier_intact_hint(two, run)] and getattr(error, HINTED) is True


def test_resume_of_a_folder_inside_a_run(tmp_path):
    from mmviews.run import RunFolderRefused
    from mmviews.train.run_folder import resume_folder, run_folder_above

    run = tmp_path / "run"
    (checkpoint,) = _run_with_checkpoints(run, 1, config=RAW)
    assert resume_folder(run) == run and resume_folder(checkpoint) == run
    (run / "encoder").mkdir()
    (run / "exported").mkdir()
    (run / "exported" / "encoder.json").write_text("{}")
    assert run_folder_above(run / "encoder") == (f"{run / 'encoder'} is the trained encoder of the run {run}, not a "
                                                 f"run folder: give the run folder (--resume {run})")
    assert run_folder_above(run / "exported").startswith(f"{run / 'exported'} is the trained encoder of the run")
    assert run_folder_above(run / "checkpoints") == (
        f"{run / 'checkpoints'} is the checkpoints folder of the run {run}: give the run folder (--resume {run} "
        f"continues from its newest checkpoint) or one checkpoint in it ({run / 'checkpoints'}/checkpoint-N)")
    with pytest.raises(RunFolderRefused, match="is the checkpoints folder of the run"):
        resume_folder(run / "checkpoints")
    assert run_folder_above(run / "notes") is None and resume_folder(tmp_path / "elsewhere") == tmp_path / "elsewhere"
    assert run_folder_above(tmp_path) is None  # the folder above a run is not inside one
    nested = run / "old"
    claim_run_dir(nested)  # a run inside a run is a run
    assert run_folder_above(nested) is None
    claim_run_dir(run / "checkpoints", resume=True)  # even one named like a run's checkpoints folder
    assert run_folder_above(run / "checkpoints") is None


def test_claim_does_what_was_decided(tmp_path, config, capsys):
    from mmviews.run import read_manifest

    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")  # the user's, there before the run
    (checkpoint,) = _run_with_checkpoints(run, 1, config=dict(RAW, seed=7))
    (run / "metrics.csv").write_text("old rows\n")
    tmp = run / "checkpoints" / ".tmp-checkpoint-00000002"
    tmp.mkdir()
    (run / ".results.json.a1b2c3d4.tmp").write_text("{")
    folder = RunFolder(run)
    auto = load_config(write_recipe(tmp_path / "auto.yaml", dict(RAW, seed=7)), ["output.auto_resume=true"])
    decided = folder.decide(auto, Intent())
    assert decided.action == CONTINUE
    before = _files(run)
    folder.claim(decided, auto)
    assert _files(run) == before and tmp.is_dir() and capsys.readouterr().err == ""  # nothing before the load
    (run / "eval").mkdir()  # written after the last manifest update (before a kill): the run's
    folder.continued(auto)
    err = capsys.readouterr().err
    assert err == (f"mmviews train: warning: removed 2 temporary left-over(s) of a write cut short: "
                   f"checkpoints/.tmp-checkpoint-00000002, .results.json.a1b2c3d4.tmp\n")
    assert not tmp.exists() and (run / "metrics.csv").read_text() == "old rows\n"
    assert yaml.safe_load((run / "config.yaml").read_text())["output"]["auto_resume"] is True
    assert "eval" in read_manifest(run)["created"] and read_manifest(run)["foreign"] == ["notes.txt"]
    folder.release()
    replace = folder.decide(config, Intent(overwrite=True))
    assert replace.action == REPLACE
    folder.claim(replace, config)
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in run.iterdir()) == [".mmviews-lock", ".mmviews-run.json", "config.yaml", "notes.txt"]
    assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == RAW["seed"]
    assert read_manifest(run)["created"] == ["config.yaml"] and read_manifest(run)["foreign"] == ["notes.txt"]
    folder.release()
    with pytest.raises(FolderInUseError):
        folder.claim(Decision_refused(run), config)


def Decision_refused(run: Path) -> Any:
    from mmviews.train.run_folder import Decision

    return Decision(REFUSE, run, error=FolderInUseError("held"))


def test_the_main_process_decides_and_says_the_notes(tmp_path, config, capsys):
    from mmviews.train.run_folder import decide_on_every_process

    run = tmp_path / "run"
    claim_run_dir(run)
    folder = RunFolder(run)
    decided = decide_on_every_process(folder, config, Intent(), True, 1)
    assert (decided.action, decided.again) == (START, True) and folder.lock.held
    assert capsys.readouterr().err == (f"mmviews train: warning: {run} has no checkpoint (the run stopped before its "
                                       "first one): starting it again from step 0\n")
    folder.release()
    # a look from another command while it is held, and the lock's own refusal, name this process
    with RunFolderLock(run):
        looked = _look(run, config)
        assert isinstance(looked.error, FolderInUseError)
        assert str(looked.error) == (f"{run} is in use by process {os.getpid()} on host {socket.gethostname()} "
                                     "(mmviews train, this process): one command at a time uses a run folder; wait "
                                     "for it to end (or stop it), or choose another --output")
        with pytest.raises(FolderInUseError, match="this process"):
            RunFolderLock(run).acquire()
    assert lock_holder(run) is None


def test_the_lock_file_names_its_holder(tmp_path):
    from mmviews.run import read_lock_holder

    path = tmp_path / LOCK_FILE
    path.write_text('{"pid": 12, "host": "h", "command": "mmviews eval"}')
    assert read_lock_holder(path) == "process 12 on host h (mmviews eval)"
    for text in ("", "{", '{"pid": "x", "host": "h", "command": "c"}', '{"pid": 1}', "[1]"):
        path.write_text(text)
        assert read_lock_holder(path) == "another process (it has not written its process id yet)", text
    path.unlink()
    assert read_lock_holder(path) == "another process (it has not written its process id yet)"
    assert lock_holder(tmp_path / "missing") is None


def test_a_link_planted_as_the_lock_file_is_never_written_through(tmp_path, config):
    from mmviews.run import RunFolderRefused

    run, target = tmp_path / "run", tmp_path / "precious.txt"
    claim_run_dir(run)
    target.write_text("keep")
    (run / LOCK_FILE).symlink_to(target)
    assert lock_holder(run) is None
    with pytest.raises(RunFolderRefused, match="is a symbolic link, not mmviews's lock file"):
        RunFolderLock(run).acquire()
    assert target.read_text() == "keep" and (run / LOCK_FILE).is_symlink()


def test_claim_of_a_run_from_before_manifests_and_of_a_new_nested_folder(tmp_path):
    from mmviews.run import read_manifest

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("config.yaml", "metrics.csv", "mine.txt"):
        (legacy / name).write_text("x")
    claim_run_dir(legacy, resume=True)  # continued: its known outputs are the run's, the rest the user's
    assert read_manifest(legacy)["created"] == ["config.yaml", "metrics.csv"]
    assert read_manifest(legacy)["foreign"] == ["mine.txt"]
    (legacy / "eval").mkdir()
    claim_run_dir(legacy, resume=True)  # written since: the run's
    assert read_manifest(legacy)["created"] == ["config.yaml", "eval", "metrics.csv"]
    claim_run_dir(legacy)  # started again: only what the run wrote is removed
    assert sorted(p.name for p in legacy.iterdir()) == [".mmviews-run.json", "mine.txt"]
    deep = tmp_path / "x" / "y" / "run"
    claim_run_dir(deep)
    assert read_manifest(deep) == {**read_manifest(deep), "created": [], "foreign": []}


def test_a_file_system_without_locks_goes_on_unlocked_and_says_so(tmp_path, config, capsys, monkeypatch):
    import errno

    import mmviews.run as run_module

    def refuse(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_module.fcntl, "lockf", refuse)
    run = tmp_path / "run"
    folder = RunFolder(run)
    assert folder.decide(config, Intent()).action == START and not folder.lock.held
    assert capsys.readouterr().err == (f"mmviews train: warning: {run / LOCK_FILE}: this file system gives no lock "
                                       f"({os.strerror(errno.ENOLCK)}): another command on {run} would not be refused\n")
    folder.release()


def test_the_decision_is_sent_to_every_process(tmp_path, config, monkeypatch, capsys):
    """With several processes the main process decides and broadcasts plain data (the
    broadcast recorded here; two real processes resume in test_reliability.py)."""
    import torch.distributed as dist

    from mmviews.train.run_folder import decide_on_every_process

    run = tmp_path / "run"
    claim_run_dir(run)
    sent: list[Any] = []

    def broadcast(data: list[Any], src: int) -> None:
        sent.append((list(data), src))
        data[:] = sent[0][0]  # what the main process sent, on every process

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    folder = RunFolder(run)
    main = decide_on_every_process(folder, config, Intent(), True, 2)
    assert len(sent) == 1 and sent[0][1] == 0 and sent[0][0] == [main.to_data()] and folder.lock.held
    other = RunFolder(run)
    follower = decide_on_every_process(other, config, Intent(), False, 2)
    assert sent[1] == ([None], 0) and not other.lock.held  # only the main process takes the lock
    assert follower.to_data() == main.to_data()
    assert capsys.readouterr().err.count("starting it again") == 1  # said by the main process only
    folder.release()


_HOLDER = """
import sys, time
from mmviews.run import RunFolderLock
lock = RunFolderLock(sys.argv[1], "mmviews eval")
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_of_another_process(tmp_path):
    """A real second process holds the folder's lock: this one is refused by name, sees it held,
    reads its record; once that process is killed the lock is free (the kernel released it)."""
    import json
    import stat

    run = tmp_path / "run"
    run.mkdir()
    with started([sys.executable, "-c", _HOLDER, str(run)], env=env()) as other:
        assert other.stdout.readline().strip() == "held", other.stderr.read()[-2000:]
        host = socket.gethostname()
        assert json.loads((run / LOCK_FILE).read_text()) == {"pid": other.pid, "host": host, "command": "mmviews eval"}
        assert (run / LOCK_FILE).read_text().endswith("}\n")
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE((run / LOCK_FILE).stat().st_mode) == 0o666 & ~umask
        holder = f"process {other.pid} on host {host} (mmviews eval)"
        assert lock_holder(run) == holder
        lock = RunFolderLock(run)
        with pytest.raises(FolderInUseError) as caught:
            lock.acquire()
        assert str(caught.value) == (f"{run} is in use by {holder}: one command at a time uses a run folder; wait for "
                                     "it to end (or stop it), or choose another --output")
        assert not lock.held
        other.kill()
        other.wait(timeout=60)
    assert lock_holder(run) is None
    lock.acquire()
    assert lock.held and lock.unsupported is None
    lock.release()
    assert not lock.held and not (run / LOCK_FILE).exists()
    lock.release()  # twice: nothing to do


def test_the_lock_in_this_process_and_without_fcntl(tmp_path, monkeypatch):
    import mmviews.run as run_module

    run = tmp_path / "run"
    run.mkdir()
    with RunFolderLock(run) as lock:
        with pytest.raises(FolderInUseError) as caught:
            RunFolderLock(run).acquire()
        assert str(caught.value) == (f"{run} is in use by process {os.getpid()} on host {socket.gethostname()} "
                                     "(mmviews train, this process): one command at a time uses a run folder; wait "
                                     "for it to end (or stop it), or choose another --output")
        assert lock.held
    assert not lock.held
    (run / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Exception) as caught:
        RunFolderLock(run).acquire()
    assert str(caught.value) == (f"{run / LOCK_FILE} is a symbolic link, not mmviews's lock file: remove it (mmviews "
                                 "never writes through a link in a run folder)")
    (run / LOCK_FILE).unlink()
    monkeypatch.setattr(run_module, "fcntl", None)
    unlocked = RunFolderLock(run)
    unlocked.acquire()
    assert unlocked.unsupported == "this platform has no fcntl record locks" and not unlocked.held
    assert lock_holder(run) is None and not (run / LOCK_FILE).exists()


def test_the_lock_is_taken_on_the_file_that_is_there(tmp_path, monkeypatch):
    """The lock file removed between the open and the lock (its holder ended): the file is
    opened again, so the lock is on the file named .mmviews-lock, not on an unlinked one."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / LOCK_FILE
    real_stat, looked = os.stat, []

    def stat_once_missing(target: Any, *args: Any, **kwargs: Any) -> Any:
        if str(target) == str(path):
            looked.append(target)
            if len(looked) == 1:
                raise FileNotFoundError(target)
        return real_stat(target, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat_once_missing)
    lock = RunFolderLock(run)
    lock.acquire()
    monkeypatch.setattr(os, "stat", real_stat)
    assert len(looked) == 2 and lock.held
    assert os.path.samestat(os.fstat(lock._fd), os.stat(path))
    lock.release()
