"""What a run writes into its own folder never costs it work:

- rotation (``output.keep_last``) keeps the checkpoint it has just committed: a checkpoint of a
  later step (a damaged one that ``auto_resume`` skipped) is kept aside under a name training never
  reads, with one warning line, instead of pushing the new one out (the issue's case: the next
  start then found "none of its 1 checkpoint(s) is intact");
- ``metrics.csv``'s rows up to a checkpoint's step are flushed to the disk before that checkpoint
  is committed (a power cut then leaves a resumed run's log whole up to its step);
- ``encoder/`` is replaced with a complete ``encoder/`` at every moment: exchanged in one rename,
  or, where folders cannot be exchanged, the old one moved aside under a name the next start puts
  back if the replacement never came;
- the next start removes mmviews's own temporary names only, never a user's folder whose name
  merely starts like one.

Runs are in the test's process, on the tiny recipe without BERT (4 steps per epoch, 8 steps)."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_utils import load_weights, own_accelerate_state, tiny_config, train_in_process, write_recipe

import mmviews.fileio as fileio
from mmviews.notices import MMViewsWarning
from mmviews.run import list_checkpoints
from mmviews.train.resume import checkpoint_fault
from mmviews.train.run_folder import remove_leftovers

CONFIG = tiny_config(num_samples=64, batch_size=16, epochs=2, text=False)
CONFIG["output"].update(checkpoint_every=2, keep_last=2, auto_resume=True)
TOTAL = 8


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


class FlushRecorder:
    """``os.fsync`` (with the last step of ``metrics.csv`` when it is the file flushed) and
    ``os.replace`` calls, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def install(self, patch: pytest.MonkeyPatch) -> None:
        fsync, replace = os.fsync, os.replace

        def recording_fsync(fd: int) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            last = None
            if Path(path).name == "metrics.csv":
                rows = list(csv.DictReader(io.StringIO(Path(path).read_text())))
                last = int(rows[-1]["step"]) if rows else 0
            fsync(fd)
            self.calls.append(("fsync", path, last))

        def recording_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            replace(src, dst, *args, **kwargs)
            self.calls.append(("replace", os.path.abspath(src), os.path.abspath(dst)))

        patch.setattr(os, "fsync", recording_fsync)
        patch.setattr(os, "replace", recording_replace)


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory) -> tuple[Path, FlushRecorder]:
    """The uninterrupted run, its flushes and renames recorded."""
    run = tmp_path_factory.mktemp("ref") / "run"
    calls = FlushRecorder()
    with pytest.MonkeyPatch.context() as patch:
        calls.install(patch)
        r = train_in_process(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run, calls


def _stopped_run(*args: str, after_step: int) -> tuple[str, list[str]]:
    """``mmviews train ARGS`` in this process, stopped after optimiser step ``after_step``
    (before its checkpoint: ``tests/slow_train.py --stop-after-step``); what it printed on
    stdout and stderr (where the ``resumed from`` line goes), and its mmviews warnings (each one
    line ``mmviews train: warning: ...`` on the command's stderr; pytest records them instead)."""
    import slow_train

    from mmviews.cli import main

    opts, rest = slow_train.parse(["--stop-after-step", str(after_step), "--", *args])
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slow_train.install(opts, patch.setattr)
        with own_accelerate_state(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            with pytest.raises(slow_train.StopAfterStep):
                main(["train", *rest])
    return out.getvalue() + err.getvalue(), [str(w.message) for w in caught if issubclass(w.category, MMViewsWarning)]


def test_rotation_keeps_the_checkpoint_just_written_when_a_damaged_later_one_was_skipped(recipe, reference, tmp_path):
    run = tmp_path / "run"
    command = [str(recipe), "--output", str(run)]
    _stopped_run(*command, after_step=7)
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint-00000004", "checkpoint-00000006"]
    damaged = list_checkpoints(run)[-1]
    with open(damaged / "model.safetensors", "r+b") as f:  # truncated by a crash of the storage
        f.truncate(100)
    # The same command, now with a checkpoint after every step and one kept; stopped after step 6
    # (before its checkpoint): the one it wrote, of step 5, is below the damaged one of step 6.
    again = [*command, "--set", "output.checkpoint_every=1", "--set", "output.keep_last=1"]
    resumed = list_checkpoints(run)[0]
    out, warned = _stopped_run(*again, after_step=6)
    assert f"resumed from {resumed} at step 4 of {TOTAL}" in out
    aside = damaged.with_name("set-aside-checkpoint-00000006")
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint-00000005"]  # the new one, not the damaged one
    assert checkpoint_fault(list_checkpoints(run)[0]) is None
    assert aside.is_dir() and checkpoint_fault(aside) is not None  # kept aside as it was, for the user
    assert [w for w in warned if "kept aside" in w] == [
        f"{damaged} is of a later step than the checkpoint of step 5 just written, so not of this run's course since it "
        "was resumed: kept aside as set-aside-checkpoint-00000006 (training never reads it; delete it once you no "
        "longer need it)"], warned

    r = train_in_process(*again)  # the next start continues from the checkpoint kept, to the end
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'checkpoint-00000005'} at step 5 of {TOTAL}" in r.stderr
    assert [c.name for c in list_checkpoints(run)] == [f"checkpoint-{TOTAL:08d}"] and aside.is_dir()
    got, want = load_weights(run / "encoder"), load_weights(reference[0] / "encoder")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_metrics_rows_reach_the_disk_before_each_checkpoint_is_committed(reference):
    run, calls = reference
    log = str(run / "metrics.csv")
    committed = [i for i, c in enumerate(calls.calls) if c[0] == "replace" and Path(c[2]).parent == run / "checkpoints"
                 and Path(c[2]).name.startswith("checkpoint-")]
    assert [Path(calls.calls[i][2]).name for i in committed] == [f"checkpoint-{s:08d}" for s in (2, 4, 6, 8)]
    previous = 0
    for i in committed:
        step = int(Path(calls.calls[i][2]).name.split("-")[1])
        flushed = [c[2] for c in calls.calls[previous:i] if c[:2] == ("fsync", log)]
        assert flushed and flushed[-1] == step, f"metrics.csv up to step {step} was not flushed before its checkpoint"
        previous = i


def _write_encoder(folder: Path, tag: str) -> None:
    (folder / "text").mkdir(parents=True)
    (folder / "encoder.json").write_text(tag)
    (folder / "text" / "model.safetensors").write_text(tag * 1000)


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("exchange", [True, False], ids=["exchanged", "moved-aside"])
def test_encoder_is_replaced_with_a_complete_encoder_at_every_moment(exchange, tmp_path, monkeypatch):
    """Every rename during the replacement is watched: after each one ``encoder/`` is complete
    (the old one or the new one); a kill right after any of them leaves, once the next start has
    cleaned up, a complete ``encoder/``."""
    run = tmp_path / "run"
    final = run / "encoder"
    fileio.save_folder(final, lambda f: _write_encoder(f, "old"))
    old = _contents(final)
    if not exchange:
        monkeypatch.setattr(fileio, "_exchange", lambda a, b: False)  # a file system that cannot exchange
    seen: list[dict[str, str]] = []
    replace, exchanged = os.replace, fileio._exchange

    def state() -> dict[str, str]:
        """``encoder/``'s files, or where it is missing, those of the old one moved aside (which the
        next start puts back)."""
        if final.is_dir():
            return _contents(final)
        aside = [p / "encoder" for p in run.iterdir() if fileio.is_previous_folder_of(p, "encoder")]
        return _contents(aside[0]) if len(aside) == 1 and not exchange else {}

    def watched(rename: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = rename(*args, **kwargs)
            seen.append(state())
            return result
        return call

    monkeypatch.setattr(os, "replace", watched(replace))
    monkeypatch.setattr(fileio, "_exchange", watched(exchanged))
    fileio.save_folder(final, lambda f: _write_encoder(f, "new"))
    new = _contents(final)
    assert new != old and new["encoder.json"] == "new"
    assert seen and all(state in (old, new) for state in seen), seen

    # A kill after each rename in turn: the next start leaves a complete encoder/
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(fileio, "_exchange", exchanged if exchange else (lambda a, b: False))
    for cut in range(len(seen)):
        shutil_copy = tmp_path / f"run{cut}"
        import shutil

        shutil.copytree(run, shutil_copy)
        renames = [0]

        class Killed(BaseException):
            pass

        def killed_after(rename: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                result = rename(*args, **kwargs)
                renames[0] += 1
                if renames[0] > cut:
                    raise Killed
                return result
            return call

        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", killed_after(replace))
            patch.setattr(fileio, "_exchange", killed_after(fileio._exchange))
            with pytest.raises(Killed):
                fileio.save_folder(shutil_copy / "encoder", lambda f: _write_encoder(f, "newer"))
        remove_leftovers(shutil_copy)
        assert _contents(shutil_copy / "encoder") in (new, {k: v.replace("new", "newer") for k, v in new.items()})
        assert sorted(p.name for p in shutil_copy.iterdir()) == ["encoder"]


def test_exchange_is_used_where_the_file_system_has_it(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write_encoder(a, "a")
    _write_encoder(b, "b")
    assert fileio._exchange(a, b)  # tmpfs and the usual Linux file systems have RENAME_EXCHANGE
    assert (a / "encoder.json").read_text() == "b" and (b / "encoder.json").read_text() == "a"


def test_the_next_start_removes_mmviews_temporary_names_only(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ours = [run / "checkpoints" / ".tmp-checkpoint-00000003", run / "checkpoints" / ".tmp-checkpoint-removed-checkpoint-00000002",
            run / ".encoder.tmp-a8b7c6d5", run / ".encoder.previous-k2j4x9q1"]
    users = [run / ".encoder-backup", run / ".encoder.tmp-backup.old", run / ".encoder.tmp-", run / ".encoder.previous-",
             run / "checkpoints" / ".tmp-checkpoint-mine", run / "checkpoints" / ".tmp-checkpoints-old",
             run / "checkpoints" / ".tmp-checkpoint-00000003.bak", run / "checkpoints" / "set-aside-checkpoint-00000004"]
    for path in ours + users:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"weights")
    (run / "encoder").mkdir()  # complete: the one moved aside is an old copy
    assert sorted(remove_leftovers(run)) == sorted(ours)
    assert all((path / "model.safetensors").read_bytes() == b"weights" for path in users)
    assert not any(path.exists() for path in ours)


def _checkpoint_folders(run: Path, steps: list[int]) -> None:
    for step in steps:
        folder = run / "checkpoints" / f"checkpoint-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "train_state.json").write_text(f'{{"step": {step}}}')


@pytest.mark.parametrize("keep_last, kept", [(1, [4]), (2, [3, 4]), (5, [2, 3, 4])])
def test_rotation_keeps_the_newest_up_to_the_one_written_and_sets_later_ones_aside(keep_last, kept, tmp_path):
    from mmviews.train.checkpoint import rotate_checkpoints

    run = tmp_path / "run"
    _checkpoint_folders(run, [2, 3, 4, 6, 10])
    (run / "checkpoints" / "set-aside-checkpoint-00000006").mkdir()  # from an earlier resume: not replaced
    committed = run / "checkpoints" / "checkpoint-00000004"
    with pytest.warns(MMViewsWarning) as said:
        removed = rotate_checkpoints(run, committed, 4, keep_last)
    assert [c.name for c in list_checkpoints(run)] == [f"checkpoint-{s:08d}" for s in kept]
    assert removed == [run / "checkpoints" / f"checkpoint-{s:08d}" for s in [2, 3, 4] if s not in kept]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("set-aside-")) == [
        "set-aside-checkpoint-00000006", "set-aside-checkpoint-00000006.2", "set-aside-checkpoint-00000010"]
    assert (run / "checkpoints" / "set-aside-checkpoint-00000010" / "train_state.json").read_text() == '{"step": 10}'
    assert [str(w.message).split(" is of ")[0] for w in said] == [
        str(run / "checkpoints" / "checkpoint-00000006"), str(run / "checkpoints" / "checkpoint-00000010")]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # the removals finished


def test_rotation_without_later_checkpoints_says_nothing(tmp_path, recwarn):
    from mmviews.train.checkpoint import rotate_checkpoints

    run = tmp_path / "run"
    _checkpoint_folders(run, [1, 2, 3])
    assert rotate_checkpoints(run, run / "checkpoints" / "checkpoint-00000003", 3, 2) == [
        run / "checkpoints" / "checkpoint-00000001"]
    assert not [w for w in recwarn if issubclass(w.category, MMViewsWarning)]


def test_the_log_is_flushed_when_asked(tmp_path, monkeypatch):
    from mmviews.train.step_log import CSVLogger

    flushed: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    log = CSVLogger(tmp_path / "metrics.csv")
    log.sync()  # nothing written yet: nothing to flush
    assert flushed == []
    log.log({"step": 1, "loss": 2.0})
    flushed.clear()
    log.sync()
    assert flushed == [str(tmp_path / "metrics.csv")]


def test_the_next_start_puts_an_encoder_moved_aside_back_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    aside = run / ".encoder.previous-k2j4x9q1"
    (aside / "encoder").mkdir(parents=True)
    (aside / "encoder" / "encoder.json").write_text("old")
    assert remove_leftovers(run) == []
    assert (run / "encoder" / "encoder.json").read_text() == "old" and not aside.exists()
    assert capsys.readouterr().err == ("mmviews train: warning: put encoder/ back from .encoder.previous-k2j4x9q1/ "
                                       "(its replacement was cut short)\n")


def test_a_left_over_that_cannot_be_removed_whole_does_not_stop_the_start(tmp_path, monkeypatch):
    """A file of a temporary folder that the system refuses to delete (another process holds it on
    a network file system, a read-only snapshot) is left: the run starts all the same."""
    import shutil

    run = tmp_path / "run"
    leftovers = [run / "checkpoints" / ".tmp-checkpoint-00000003", run / ".encoder.tmp-a8b7c6d5"]
    for folder in leftovers:
        folder.mkdir(parents=True)
        (folder / "stuck.bin").write_bytes(b"x")
    unlink = os.unlink

    def refusing(path, *args, **kwargs):
        if str(path).endswith("stuck.bin"):
            raise PermissionError(13, "Permission denied", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refusing)
    assert sorted(remove_leftovers(run)) == sorted(leftovers)
    monkeypatch.setattr(os, "unlink", unlink)
    shutil.rmtree(run)


def test_a_full_disk_when_the_log_is_flushed_is_the_short_error(tmp_path, monkeypatch):
    import errno

    from mmviews.fileio import DiskFullError
    from mmviews.train.step_log import CSVLogger

    log = CSVLogger(tmp_path / "metrics.csv")
    log.log({"step": 1, "loss": 2.0})
    monkeypatch.setattr(fileio, "free_bytes", lambda folder: 0)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(DiskFullError, match=f"^{tmp_path}: no space left while writing metrics.csv: it needs about 0 "
                                            "bytes, 0 bytes are free"):
        log.sync()


class _Processes:
    """The part of an Accelerator that ``_claim_run_dir`` uses: which process this is, and the barrier."""

    def __init__(self, main: bool) -> None:
        self.is_main_process, self.waited = main, 0

    def wait_for_everyone(self) -> None:
        self.waited += 1


def test_the_main_process_claims_the_folder_says_where_the_data_comes_from_and_records_what_the_run_wrote(
        tmp_path, capsys, monkeypatch):
    """Without a training: the folder claimed as decided (manifest, ``config.yaml``), the
    training split's own note printed (a video folder says which split lists it read), every
    process at the barrier, and however the run ends the manifest lists what it wrote by then;
    another process only waits."""
    from types import SimpleNamespace

    from mmviews.config import load_config
    from mmviews.run import CONFIG_FILE, read_manifest
    from mmviews.train.run_folder import Intent, RunFolder
    from mmviews.train.trainer import _claim_run_dir

    config = load_config(write_recipe(tmp_path / "tiny.yaml", CONFIG))
    run = tmp_path / "run"
    folder = RunFolder(run)
    note = "ucf101 /data/ucf: 7 clips, split lists from /data/ucf/ucfTrainTestlist"
    parts = SimpleNamespace(config=config, datasets={"train": SimpleNamespace(source_note=note)})
    other = _Processes(main=False)
    with contextlib.ExitStack() as on_exit:
        _claim_run_dir(other, parts, folder, folder.decide(config, Intent(), act=False), on_exit)
    assert other.waited == 1 and not run.exists() and capsys.readouterr().out == ""
    main = _Processes(main=True)
    try:
        decision = folder.decide(config, Intent())
        piped = io.BytesIO()  # stdout into a pipe (block-buffered): the line must be there before the run's bars
        with contextlib.ExitStack() as on_exit:
            with monkeypatch.context() as patch:
                patch.setattr(sys, "stdout", io.TextIOWrapper(piped, encoding="utf-8"))
                _claim_run_dir(main, parts, folder, decision, on_exit)
                assert piped.getvalue().decode() == f"data: {note}\n"  # flushed, not left in the buffer
            assert main.waited == 1 and (run / CONFIG_FILE).is_file()
            (run / "metrics.csv").write_text("step\n")  # written by the run after the claim
        assert "metrics.csv" in read_manifest(run)["created"]  # recorded on the way out
        parts.datasets["train"] = SimpleNamespace()  # a dataset with nothing to say prints nothing
        again = RunFolder(tmp_path / "second")
        with contextlib.ExitStack() as on_exit:
            _claim_run_dir(main, parts, again, again.decide(config, Intent()), on_exit)
        again.release()
        assert capsys.readouterr().out == ""
    finally:
        folder.release()


def test_no_checkpoint_follows_a_non_finite_loss(tmp_path):
    """``_checkpoint`` checks the losses since the last check first: after a NaN it raises the
    run's one-line error naming the steps and the log interval, before the log is flushed or
    anything is written."""
    from types import SimpleNamespace

    from mmviews.train.trainer import _checkpoint

    flushed: list[int] = []
    state = SimpleNamespace(step=4, epoch=1)
    p = SimpleNamespace(nonfinite=torch.tensor(True), checked_step=2, state=state,
                        accelerator=SimpleNamespace(num_processes=1))
    run = SimpleNamespace(p=p, run_dir=tmp_path / "run", config=SimpleNamespace(output=SimpleNamespace(
        log_every=5, keep_last=2)), log=SimpleNamespace(sync=lambda: flushed.append(1)))
    with pytest.raises(FloatingPointError) as raised:
        _checkpoint(run)
    assert str(raised.value).startswith("non-finite loss (NaN or inf) at one of steps 3-4 (epoch 1; the loss is checked "
                                        "at log steps, output.log_every = 5, and before checkpoints)")
    assert flushed == [] and not (tmp_path / "run").exists()
