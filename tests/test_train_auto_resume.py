"""The same command continues a run (``output.auto_resume``, :mod:`mmviews.train.run_folder`), and a
run's commits are durable (:mod:`mmviews.fileio`).

- A run stopped after step 3 of 4 (checkpoints at steps 1 and 2), whose newest checkpoint is then
  damaged and whose folder holds temporary left-overs of mmviews and files of the user's: the same
  command says which checkpoint it skips and why, continues from step 1, removes only mmviews's
  own temporary names, and ends on the weights of an uninterrupted run; run again, it says the run
  has finished (exit status 0); with another recipe it is refused, naming the keys.
- Every checkpoint, ``encoder/`` and ``results.json`` of a run is committed durably: its files
  flushed, then the rename, then the parent folder flushed (the calls recorded in that order).

Runs are in the test's process (:func:`test_train_utils.train_in_process`), on the tiny recipe
without BERT: 4 optimiser steps, a checkpoint after every one."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from crafted_files import one_line_error
from test_train_utils import CallRecorder, check_committed_durably, load_weights, tiny_config, train_in_process, write_recipe

from mmviews.config import load_config
from mmviews.run import list_checkpoints
from mmviews.train.resume import checkpoint_fault, recipe_differences
from mmviews.train.run_folder import remove_leftovers

CONFIG = tiny_config(num_samples=32, batch_size=16, epochs=2, text=False)
CONFIG["output"].update(checkpoint_every=1, keep_last=10, auto_resume=True)
TOTAL = 4


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory) -> tuple[Path, CallRecorder]:
    """The uninterrupted run (with auto_resume on a new folder: it simply starts), its
    ``os.fsync``/``os.replace`` calls recorded."""
    run = tmp_path_factory.mktemp("ref") / "run"
    calls = CallRecorder()
    with pytest.MonkeyPatch.context() as patch:
        calls.install(patch)
        r = train_in_process(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed" not in r.stdout
    assert "output.keep_last" not in r.stderr  # 10 kept: no warning
    return run, calls


KEEP_ONE = ("mmviews train: warning: output.keep_last = 1 with output.auto_resume: if the newest checkpoint is damaged "
            "there is no other to continue from and the same command refuses the folder; set output.keep_last=2 "
            "(one more checkpoint on the disk)")


def test_keeping_one_checkpoint_under_auto_resume_is_warned_about(recipe, tmp_path):
    """The reliability page's case: with one checkpoint kept, a damaged newest one leaves nothing
    to continue from. `--check` and the run's start say so once; two kept, or no auto_resume,
    say nothing."""
    from mmviews.train.resume import auto_resume_lines

    checked = train_in_process(str(recipe), "--output", str(tmp_path / "c"), "--check", "--set", "output.keep_last=1")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stderr.count(KEEP_ONE) == 1, checked.stderr
    run = train_in_process(str(recipe), "--output", str(tmp_path / "r"), "--set", "output.keep_last=1",
                           "--set", "optimisation.max_steps=1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count(KEEP_ONE) == 1, run.stderr
    config = load_config(recipe, ["output.keep_last=2"])
    assert auto_resume_lines(config) == []
    assert auto_resume_lines(load_config(recipe, ["output.keep_last=1", "output.auto_resume=false"])) == []
    assert auto_resume_lines(load_config(recipe, ["output.keep_last=1"])) == [KEEP_ONE.split("warning: ", 1)[1]]


def test_checkpoints_encoder_and_results_are_committed_durably(reference):
    run, calls = reference
    checkpoints = list_checkpoints(run)
    assert len(checkpoints) == TOTAL
    for final in checkpoints:
        tmp = final.with_name(".tmp-" + final.name)
        check_committed_durably(calls, tmp, final, sorted(p.name for p in final.iterdir()))
    encoder_tmp = [Path(c[1]) for c in calls.calls if c[0] == "replace" and c[2] == str(run / "encoder")]
    assert len(encoder_tmp) == 1 and encoder_tmp[0].name.startswith(".encoder.tmp-")
    written = sorted(str(p.relative_to(run / "encoder")) for p in (run / "encoder").rglob("*")
                     if p.name != "README.md")  # the model card is written later, by itself (atomically)
    check_committed_durably(calls, encoder_tmp[0], run / "encoder", written)
    results_tmp = [Path(c[1]) for c in calls.calls if c[0] == "replace" and c[2] == str(run / "results.json")]
    assert results_tmp, "results.json was not written through a temporary file"
    renamed = calls.index(("replace", str(results_tmp[-1]), str(run / "results.json")))
    assert calls.calls.index(("fsync", str(results_tmp[-1]))) < renamed
    assert ("fsync", str(run)) in calls.calls[renamed + 1:]


def test_durability_check_fails_when_folders_are_renamed_unflushed(tmp_path, monkeypatch):
    """The order check above catches a commit that renames without flushing (break
    ``commit_without_flush``)."""
    from mutations import apply_break

    import mmviews.fileio as fileio

    tmp, final = tmp_path / ".tmp-x", tmp_path / "x"
    tmp.mkdir()
    (tmp / "a.bin").write_bytes(b"a")
    calls = CallRecorder()
    calls.install(monkeypatch)
    fileio.commit_folder(tmp, final)
    check_committed_durably(calls, tmp, final, ["a.bin"])  # intact: passes
    final.rename(tmp)
    apply_break("commit_without_flush", monkeypatch.setattr)
    calls.calls.clear()
    fileio.commit_folder(tmp, final)
    with pytest.raises(AssertionError, match="was not flushed"):
        check_committed_durably(calls, tmp, final, ["a.bin"])


def _stopped_run(recipe: Path, run: Path, after_step: int) -> None:
    """``mmviews train RECIPE --output RUN`` stopped after optimiser step ``after_step`` (before
    its checkpoint), in this process (``tests/slow_train.py --stop-after-step``)."""
    import slow_train

    opts, rest = slow_train.parse(["--stop-after-step", str(after_step), "--", str(recipe), "--output", str(run)])
    with pytest.MonkeyPatch.context() as patch:
        slow_train.install(opts, patch.setattr)
        with pytest.raises(slow_train.StopAfterStep):
            train_in_process(*rest)


def test_same_command_continues_from_the_newest_intact_checkpoint(recipe, reference, tmp_path):
    run = tmp_path / "run"
    _stopped_run(recipe, run, after_step=3)
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint-00000001", "checkpoint-00000002"]
    damaged = list_checkpoints(run)[-1]
    with open(damaged / "model.safetensors", "r+b") as f:  # truncated by a crash of the storage
        f.truncate(100)
    leftovers, mine = _leftovers(run)
    r = train_in_process(str(recipe), "--output", str(run))  # the same command
    check_continued(r, run, damaged, leftovers, mine, resumed_step=1)
    got, want = load_weights(run / "encoder"), load_weights(reference[0] / "encoder")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    r = train_in_process(str(recipe), "--output", str(run))  # finished: nothing to do
    assert r.returncode == 0 and "has already finished" in r.stdout, r.stderr
    # the same command refuses a changed recipe, so what it suggests goes through --resume
    resume = f"mmviews train --resume {shlex.quote(str(run))}"
    assert r.stdout.rstrip().endswith(
        f"nothing to do. {resume} --reevaluate runs its evaluation again; {resume} --set optimisation.epochs=N "
        "(more than 2) trains it longer"), r.stdout


def check_continued(r: Any, run: Path, damaged: Path, leftovers: list[Path], mine: list[Path], resumed_step: int) -> None:
    """The same command continued from the checkpoint of ``resumed_step``, skipping ``damaged``
    in one line, removing the ``leftovers`` and none of the user's files (``mine``)."""
    assert r.returncode == 0, r.stderr[-3000:]
    # the folder's lines are warnings, on stderr (docs/cli.md: "Errors and warnings")
    assert "skipping" not in r.stdout and "resumed from" not in r.stdout and "removed" not in r.stdout, r.stdout
    skipped = [line for line in r.stderr.splitlines() if "skipping the damaged checkpoint" in line]
    assert len(skipped) == 1 and str(damaged) in skipped[0] and "100 bytes" in skipped[0], r.stderr
    assert skipped[0].startswith("mmviews train: warning: skipping the damaged checkpoint ")
    resumed = run / "checkpoints" / f"checkpoint-{resumed_step:08d}"
    assert f"mmviews train: warning: resumed from {resumed} at step {resumed_step} of {TOTAL}" in r.stderr
    assert f"mmviews train: warning: removed {len(leftovers)} temporary left-over(s)" in r.stderr
    assert not any(path.exists() for path in leftovers)
    assert all(path.read_text() == "mine" for path in mine)


def _leftovers(run: Path) -> tuple[list[Path], list[Path]]:
    """Left-overs of a kill (mmviews's temporary names) and the user's own files, which stay."""
    leftovers = [run / "checkpoints" / ".tmp-checkpoint-00000003", run / ".results.json.k2j4x9q1.tmp",
                 run / ".encoder.tmp-a8b7c6d5"]
    for path in leftovers:
        if path.suffix == ".tmp":
            path.write_text("{")
        else:
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"half")
    mine = [run / "checkpoints" / "notes.tmp", run / ".my-notes.tmp", run / "checkpoints" / "tmp-checkpoint-5"]
    for path in mine:
        path.write_text("mine")
    return leftovers, mine


@pytest.mark.parametrize("name", ["resume_newest_unchecked", "keep_leftovers"])
def test_continue_check_fails_when_broken(name, recipe, reference, tmp_path, monkeypatch):
    """The checks of the test above fail when the newest checkpoint is taken unchecked, or the
    left-overs are kept (a copy of the reference run, as stopped before its end)."""
    import shutil

    from mutations import apply_break

    run = shutil.copytree(reference[0], tmp_path / "run")
    for finished in (run / "results.json", run / "encoder"):
        shutil.rmtree(finished) if finished.is_dir() else finished.unlink()
    damaged = list_checkpoints(run)[-1]
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(100)
    leftovers, mine = _leftovers(run)
    apply_break(name, monkeypatch.setattr)
    r = train_in_process(str(recipe), "--output", str(run))
    with pytest.raises(AssertionError):
        check_continued(r, run, damaged, leftovers, mine, resumed_step=TOTAL - 1)


def test_a_differing_recipe_is_refused_naming_the_keys(reference, tmp_path, capsys):
    from crafted_files import cli, copy_run

    run = copy_run(reference[0], tmp_path / "run")
    changed = dict(CONFIG, seed=1, optimisation={**CONFIG["optimisation"], "lr": 0.1},
                   output={**CONFIG["output"], "log_every": 2, "keep_last": 3})  # output.* may differ
    other = write_recipe(tmp_path / "other.yaml", changed)
    rc, _, err = cli(capsys, "train", str(other), "--output", str(run))
    line = one_line_error(err)
    assert rc == 2 and "optimisation.lr, seed" in line and "output." not in line.split("in optimisation.lr")[1][:20], line
    rc, _, err = cli(capsys, "train", str(other), "--output", str(run), "--overwrite")
    assert rc == 2 and "choose one" in one_line_error(err)


def test_recipe_check_fails_when_any_recipe_continues(reference, tmp_path, capsys, monkeypatch):
    from crafted_files import cli, copy_run
    from mutations import apply_break

    run = copy_run(reference[0], tmp_path / "run")
    other = write_recipe(tmp_path / "other.yaml", dict(CONFIG, seed=1))
    apply_break("any_recipe_continues", monkeypatch.setattr)
    rc, _, err = cli(capsys, "train", str(other), "--output", str(run))
    assert rc == 0 and "error" not in err  # the differing recipe is not refused


def test_recipe_differences_and_leftovers_units(tmp_path):
    config = load_config(write_recipe(tmp_path / "a.yaml", CONFIG))
    assert recipe_differences(config, config) == []
    other = load_config(write_recipe(tmp_path / "b.yaml", dict(
        CONFIG, output={**CONFIG["output"], "dir": "elsewhere", "trackers": ["tensorboard"]},
        data={**CONFIG["data"], "batch_size": 8})))
    assert recipe_differences(config, other) == ["data.batch_size"]
    assert remove_leftovers(tmp_path / "missing") == []


def test_checkpoint_fault_names_what_is_wrong(reference, tmp_path):
    import shutil

    checkpoint = shutil.copytree(list_checkpoints(reference[0])[0], tmp_path / "checkpoint-00000001")
    assert checkpoint_fault(checkpoint) is None
    (checkpoint / "objective.pt").unlink()
    assert "objective.pt is missing" in checkpoint_fault(checkpoint)
    (checkpoint / "train_state.json").write_text("{")
    assert "not valid JSON" in checkpoint_fault(checkpoint)


def test_every_checkpoint_damaged_is_one_line(reference, tmp_path, capsys):
    from crafted_files import cli, copy_run

    run = copy_run(reference[0], tmp_path / "run", unfinished=True)
    for checkpoint in list_checkpoints(run):
        (checkpoint / "optimizer.bin").write_bytes(b"x")
    rc, out, err = cli(capsys, "train", str(run / "config.yaml"), "--output", str(run))
    line = one_line_error(err)
    assert rc == 2 and f"none of its {TOTAL} checkpoint(s) is intact" in line and "--overwrite" in line
    # only --overwrite helps: no hint that the same command, or --resume, would continue
    assert "latest checkpoint is kept" not in line and "same command" not in line and "--resume" not in line, line
    assert err.count("mmviews train: warning: skipping the damaged checkpoint") == TOTAL and "skipping" not in out


def _fake_checkpoint(run: Path, step: int) -> Path:
    """A checkpoint folder with one recorded file (no training needed)."""
    import json

    from mmviews.run import checkpoint_file_records

    folder = run / "checkpoints" / f"checkpoint-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(step)) * 10)
    record = {"epoch": 0, "batch_in_epoch": step, "step": step, "samples": 0, "files": checkpoint_file_records(folder)}
    (folder / "train_state.json").write_text(json.dumps(record))
    return folder


def _decide(config: Any, run: Path, **intent: Any) -> Any:
    """What the command would do with ``run`` (looked at only, as ``--check`` does)."""
    from mmviews.train.run_folder import Intent, RunFolder

    return RunFolder(run).decide(config, Intent(**intent), act=False)


def test_newest_intact_checkpoint_units(tmp_path):
    from mmviews.train.run_folder import CONTINUE, REFUSE, START, claim_run_dir, newest_intact_checkpoint

    run = tmp_path / "run"
    said: list[str] = []
    assert newest_intact_checkpoint(run, said.append) is None and said == []
    config = load_config(write_recipe(tmp_path / "a.yaml", CONFIG))
    assert _decide(config, run).action == START and not run.exists()  # looking creates nothing
    claim_run_dir(run)  # an mmviews run folder (its manifest)
    first, second, third = (_fake_checkpoint(run, step) for step in (1, 2, 3))
    (third / "model.safetensors").write_bytes(b"")  # its size's message goes on "; resume from an earlier ..."
    (second / "model.safetensors").unlink()
    assert newest_intact_checkpoint(run, said.append) == first
    assert len(said) == 2 and said[0].startswith(f"skipping the damaged checkpoint {third}: ")
    assert said[0].endswith("0 bytes, 30 when the checkpoint was written: truncated or replaced"), said[0]
    assert str(second) in said[1] and "is missing" in said[1] and ";" not in said[1]
    decided = _decide(config, run)
    assert (decided.action, decided.checkpoint, decided.step, decided.notes) == (CONTINUE, first, 1, said)
    assert decided.line() == f"{run}: the run continues from {first} (step 1)"
    (first / "train_state.json").unlink()  # checkpoint-1 lost its record
    assert newest_intact_checkpoint(run, said.append) is None
    decided = _decide(config, run)
    assert decided.action == REFUSE and decided.checkpoint is None and decided.run_dir == run
    assert len(decided.notes) == 3 and all(n.startswith("skipping the damaged checkpoint") for n in decided.notes)
    assert str(decided.error) == (f"{run}: none of its 3 checkpoint(s) is intact (see above), nothing to continue "
                                  "from; --overwrite starts the run again")


def test_recipe_check_units(tmp_path):
    from mmviews.config import dotted_keys
    from mmviews.train.run_folder import CONTINUE, REFUSE

    assert dotted_keys({"a": {"b": 1, "c": {}}, "d": [1, {"e": 2}]}) == {"a.b": 1, "a.c": {}, "d": [1, {"e": 2}]}
    run = tmp_path / "run"
    _fake_checkpoint(run, 1)
    (run / ".mmviews-run.json").write_text('{"format": "mmviews-run", "version": 1, "created": [], "foreign": []}')
    config = load_config(write_recipe(tmp_path / "a.yaml", CONFIG))
    assert _decide(config, run).action == CONTINUE  # no config.yaml: nothing to compare
    write_recipe(run / "config.yaml", CONFIG)
    assert _decide(config, run).action == CONTINUE
    many = dict(CONFIG, seed=3, optimisation={**CONFIG["optimisation"], "lr": 1.0, "epochs": 9, "warmup_steps": 0,
                                               "max_grad_norm": 1.0, "optimizer": "sgd", "momentum": 0.5,
                                               "weight_decay": 0.5}, data={**CONFIG["data"], "batch_size": 8})
    decided = _decide(load_config(write_recipe(tmp_path / "b.yaml", many)), run)
    message = str(decided.error)
    assert decided.action == REFUSE
    assert message.startswith(f"output.auto_resume: the recipe differs from the one {run} was started with")
    assert "in data.batch_size, optimisation.epochs, optimisation.lr," in message and "weight_decay and 1 more;" in message
    assert f"--resume {run} --set KEY=VALUE" in message
    eight = dict(many, seed=CONFIG["seed"])  # eight keys: all named, no "more"
    assert "optimisation.weight_decay; use that recipe" in str(_decide(load_config(write_recipe(tmp_path / "c.yaml",
                                                                                                  eight)), run).error)


def test_recipe_differences_count_keys_on_one_side_only():
    from types import SimpleNamespace

    from mmviews.train.resume import recipe_differences

    def config(values: dict) -> Any:
        return SimpleNamespace(to_dict=lambda: values)

    ours, theirs = config({"a": {"b": 1}, "output": {"x": 1}}), config({"a": {"b": 1, "c": None}, "d": 0})
    assert recipe_differences(ours, theirs) == recipe_differences(theirs, ours) == ["a.c", "d"]


def test_remove_leftovers_units(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ours = [run / "checkpoints" / ".tmp-checkpoint-00000007", run / "checkpoints" / ".tmp-checkpoint-removed-checkpoint-1",
            run / ".encoder.tmp-x1y2z3", run / ".config.yaml.abcd1234.tmp", run / "..mmviews-run.json.k2j4x9q1.tmp",
            run / ".metrics.csv.a1b2c3d4.tmp", run / ".report.md.a1b2c3d4.tmp"]
    for path in ours:
        path.mkdir() if "tmp-" in path.name else path.write_text("x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    theirs = [run / ".notes.json.abcd1234.tmp", run / "checkpoints" / ".tmp-checkpoint-file", run / ".encoder.tmp-file",
              run / ".results.json.tmp", run / "encoder.tmp-x"]
    for path in theirs:
        path.write_text("mine")
    (run / ".encoder.tmp-link").symlink_to(elsewhere)
    (run / "checkpoints" / ".tmp-checkpoint-link").symlink_to(elsewhere)
    assert sorted(remove_leftovers(run)) == sorted(ours)
    assert not any(path.exists() for path in ours) and all(path.read_text() == "mine" for path in theirs)
    assert (elsewhere / "keep").read_text() == "mine" and (run / ".encoder.tmp-link").is_symlink()


def test_restart_attempt_reads_the_agents_count(monkeypatch):
    from mmviews.train.resume import restart_attempt

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_attempt() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_attempt() == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    assert restart_attempt() == 0
