"""Kill `mmviews train` with SIGKILL (mid-run, mid accumulation window, while a checkpoint is
being written, while an old checkpoint is being deleted), resume, and check that the resumed
process says where it continues, runs exactly the optimiser steps after the checkpoint with the
counters of the uninterrupted run at each of them (samples seen, epoch, position in the epoch,
the scheduler's step and learning rates: recorded by ``tests/slow_train.py --record``), and
finishes with weights identical to an uninterrupted run.

Only the processes that are killed run as subprocesses, plus the resume of the plain SIGKILL
test (a fresh interpreter, as a user resumes). The uninterrupted runs and the other resumes run
in the test's own process (:func:`train_recorded_in_process`: one thread, as the subprocesses,
so the weights are bitwise those of a subprocess run), each at most once per configuration. The
recipes have no BERT (``tiny_config(text=False)``): the RNG-state restore is still needed for
the dropout of the projection heads, and the BatchNorm buffers for theirs.

Weights alone cannot show a resume: a run that silently restarts at step 0 with the same seed
reaches the same weights. The steps, the counters and the ``resumed from`` line can, and
:func:`test_resume_checks_fail_when_the_restore_is_broken` shows they do.

Checkpoint rotation (``output.keep_last``) never leaves a run without a complete checkpoint: a
kill after the new checkpoint is written but before its rename, or in the middle of an old
checkpoint's deletion, leaves only complete ``checkpoint-N`` folders, and the run resumes."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_utils import (
    REPO,
    env,
    kill_group,
    load_weights,
    own_accelerate_state,
    read_record,
    started,
    tiny_config,
    wait_for_file,
    write_recipe,
)

from mmviews.run import list_checkpoints, load_run

SLOW_TRAIN = Path(__file__).resolve().parent / "slow_train.py"

# 4 batches per epoch x 3 epochs = 12 optimiser steps, a checkpoint every 2 steps (all kept).
# Dropout and BatchNorm are on, so equality also needs the RNG states and BN buffers restored.
# (12 steps, not 8: a resume from the mid-epoch checkpoint of step 6 then crosses an epoch end.)
CONFIG = tiny_config(num_samples=64, batch_size=16, epochs=3, dropout=0.1, batch_norm=True, text=False)
CONFIG["output"]["keep_last"] = 10
TOTAL = 12


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


def train_recorded(tmp_path: Path, *args: str, timeout: float = 300) -> list[dict[str, Any]]:
    """An uninterrupted ``mmviews train ARGS`` through ``slow_train --record``: its per-step
    counters (also left in ``tmp_path/steps-<k>.jsonl``)."""
    record = tmp_path / f"steps-{len(list(tmp_path.glob('steps-*')))}.jsonl"
    r = subprocess.run([sys.executable, str(SLOW_TRAIN), "--record", str(record), "--", *args],
                       capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_record(record)


def train_recorded_in_process(tmp_path: Path, *args: str,
                              options: tuple[str, ...] = ()) -> tuple[str, list[dict[str, Any]]]:
    """``tests/slow_train.py --record FILE OPTIONS -- ARGS`` in the test's own process, one
    interpreter start fewer than :func:`train_recorded`: (stdout then stderr, the per-step counters, also
    left in ``tmp_path/steps-<k>.jsonl``). ``slow_train``'s patches (its callback, a ``--break``)
    are undone on return. One torch thread, as the subprocesses (``OMP_NUM_THREADS=1``): the
    weights are bitwise those of the same run in a subprocess. For runs that are not killed or
    signalled (no hold option)."""
    import slow_train

    from mmviews.cli import main

    record = tmp_path / f"steps-{len(list(tmp_path.glob('steps-*')))}.jsonl"
    opts, rest = slow_train.parse(["--record", str(record), *options, "--", *args])
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, own_accelerate_state():
        slow_train.install(opts, patch.setattr)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(["train", *rest])
        except slow_train.StopAfterStep:  # --stop-after-step: the steps needed are done
            rc = 0
    assert rc == 0, err.getvalue()[-3000:]
    return out.getvalue() + err.getvalue(), read_record(record)


def _resume_here(run: Path, tmp_path: Path, *options: str) -> tuple[str, list[dict[str, Any]]]:
    """:func:`_resume` in the test's own process (:func:`train_recorded_in_process`)."""
    return train_recorded_in_process(tmp_path, "--resume", str(run), options=options)


@pytest.fixture(scope="module")
def reference_run(recipe, tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """The uninterrupted run's folder and its per-step counters (in this process)."""
    folder = tmp_path_factory.mktemp("ref")
    _, records = train_recorded_in_process(folder, str(recipe), "--output", str(folder / "run"))
    assert [r["step"] for r in records] == list(range(1, TOTAL + 1))
    return folder / "run", records


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[str, torch.Tensor]:
    return load_weights(reference_run[0] / "encoder")


def _logged_steps(run: Path) -> list[int]:
    return [int(row["step"]) for row in csv.DictReader((run / "metrics.csv").open())]


def _slow_train(*options: str) -> list[str]:
    """``tests/slow_train.py OPTIONS`` (its own options, ``--``, then ``mmviews train``'s)."""
    return [sys.executable, str(SLOW_TRAIN), *options]


def _kill_when_held(proc: subprocess.Popen, marker: Path, what: str, timeout: float = 180) -> None:
    """SIGKILL ``proc`` (its process group) once it holds at the chosen point (``slow_train``
    writes ``marker`` and then sleeps: the process is stopped there when the marker exists,
    whatever the timing)."""
    wait_for_file(proc, marker, what, timeout)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL


def _resume(run: Path, tmp_path: Path, *options: str) -> tuple[str, list[dict[str, Any]]]:
    """``mmviews train --resume RUN`` through ``slow_train --record``: (stdout then stderr, the rows of the
    optimiser steps this process ran)."""
    record = tmp_path / f"steps-{len(list(tmp_path.glob('steps-*')))}.jsonl"
    r = subprocess.run([sys.executable, str(SLOW_TRAIN), "--record", str(record), *options, "--", "--resume", str(run)],
                       capture_output=True, text=True, timeout=180, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr, read_record(record)


def check_resumed_exactly(stdout: str, rows: list[dict[str, Any]], checkpoint: Path, total: int,
                          reference_rows: list[dict[str, Any]]) -> None:
    """The guard of "resume == uninterrupted" beyond the weights: the process said where it
    continued, ran exactly the optimiser steps after ``checkpoint``, each once, and at each of
    them its counters (samples seen, epoch, batch in epoch, the scheduler's step and learning
    rates) are those of the uninterrupted run (``reference_rows``, from ``slow_train --record``)."""
    at = int(checkpoint.name.split("-")[1])
    line = f"mmviews train: warning: resumed from {checkpoint} at step {at} of {total}"  # on stderr
    assert [ln for ln in stdout.splitlines() if "resumed from" in ln] == [line], stdout[-2000:]
    steps = [row["step"] for row in rows]
    assert steps == list(range(at + 1, total + 1)), f"resumed from step {at}, ran steps {steps}"
    assert [r["step"] for r in reference_rows] == list(range(1, total + 1))
    for row, expected in zip(rows, reference_rows[at:]):
        assert row == expected, f"step {row['step']}: resumed {row}, uninterrupted {expected}"


def check_checkpoints_complete(run: Path) -> Path:
    """Every ``checkpoint-N`` folder of ``run`` is complete: its ``train_state.json`` lists
    exactly the files present, each with its size and SHA-256 (computed here). Returns the
    latest; there must be one."""
    checkpoints = sorted((run / "checkpoints").glob("checkpoint-*"))
    assert checkpoints, f"no checkpoint left in {run / 'checkpoints'}: {sorted((run / 'checkpoints').iterdir())}"
    for checkpoint in checkpoints:
        state_file = checkpoint / "train_state.json"
        assert state_file.is_file(), f"{checkpoint} has no train_state.json"
        files = json.loads(state_file.read_text())["files"]
        present = sorted(p.name for p in checkpoint.iterdir() if p.name != "train_state.json")
        assert present == sorted(files), f"{checkpoint}: files {present}, recorded {sorted(files)}"
        for name, record in files.items():
            data = (checkpoint / name).read_bytes()
            assert len(data) == record["bytes"] and hashlib.sha256(data).hexdigest() == record["sha256"], \
                f"{checkpoint / name} differs from its record"
    return checkpoints[-1]


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


def test_sigkill_mid_run_then_resume_runs_only_the_remaining_steps(recipe, reference_run, reference, tmp_path):
    kill_after = 7  # mid-epoch 2, one step past the checkpoint of step 6: that step is redone
    # The killed run and its resume are subprocesses: the resume is a fresh interpreter, as a user's.
    run, marker = tmp_path / "run", tmp_path / "held"
    with started(_slow_train("--hold-after-step", str(kill_after), "--hold-marker", str(marker), "--",
                             str(recipe), "--output", str(run))) as proc:
        _kill_when_held(proc, marker, f"step {kill_after}")
    assert not (run / "encoder").exists(), "the run finished before the kill"
    assert _logged_steps(run)[-1] == kill_after
    checkpoint = list_checkpoints(run)[-1]
    assert checkpoint.name == "checkpoint-00000006", [c.name for c in list_checkpoints(run)]

    stdout, rows = _resume(run, tmp_path)
    check_resumed_exactly(stdout, rows, checkpoint, TOTAL, reference_run[1])
    _assert_identical(load_weights(run / "encoder"), reference)
    # The log continues from the checkpoint without duplicated steps (step 7 is logged once).
    assert _logged_steps(run) == list(range(1, TOTAL + 1))
    # The summary's counters are the uninterrupted run's.
    done, ref = (json.loads((r / "results.json").read_text()) for r in (run, reference_run[0]))
    assert (done["steps"], done["epochs"], done["samples_seen"]) == (ref["steps"], ref["epochs"], ref["samples_seen"])


def _kill_before_rename(recipe: Path, run: Path, marker: Path, step: int, *options: str) -> None:
    """Start the recipe with ``output.keep_last: 1`` and SIGKILL it once the checkpoint of
    ``step`` is complete in its temporary folder, before the rename (and the rotation)."""
    with started(_slow_train(*options, "--hold-after-checkpoint", str(step), "--hold-marker", str(marker), "--",
                             str(recipe), "--output", str(run), "--set", "output.keep_last=1")) as proc:
        _kill_when_held(proc, marker, f"the checkpoint of step {step}")


def _kill_mid_removal(recipe: Path, run: Path, marker: Path, *options: str) -> None:
    """Start the recipe with ``keep_last: 1`` and SIGKILL it in the middle of the first deletion
    under ``checkpoints/``: that of checkpoint-2, once checkpoint-4 is renamed into place."""
    with started(_slow_train(*options, "--hold-in-removal", "--hold-marker", str(marker), "--",
                             str(recipe), "--output", str(run), "--set", "output.keep_last=1")) as proc:
        _kill_when_held(proc, marker, "the deletion of an old checkpoint")


def test_kills_during_checkpoint_rotation_leave_complete_checkpoints_and_resume(recipe, reference_run, reference,
                                                                                 tmp_path):
    """Rotation with ``keep_last: 1``, killed at its two moments. First in the middle of the
    deletion of checkpoint-2 (checkpoint-4 renamed into place): an old checkpoint is renamed away
    before it is deleted, so no half-deleted ``checkpoint-N`` is left. Then the resumed process,
    once the checkpoint of step 6 is complete in its temporary folder but not renamed: the old
    checkpoint is only deleted once the new one is in place, so checkpoint-4 is still there,
    complete. The last resume (in this process) runs steps 5-12 to the uninterrupted run's
    counters and weights."""
    run, folder = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _kill_mid_removal(recipe, run, tmp_path / "held-removal")
    assert check_checkpoints_complete(run).name == "checkpoint-00000004"
    assert [p.name for p in folder.iterdir() if p.name.startswith(".tmp")], "the deletion was not cut short"

    with started(_slow_train("--hold-after-checkpoint", "6", "--hold-marker", str(tmp_path / "held-write"), "--",
                             "--resume", str(run))) as proc:
        _kill_when_held(proc, tmp_path / "held-write", "the checkpoint of step 6")
    tmp = folder / ".tmp-checkpoint-00000006"
    assert tmp.is_dir(), "the half-written checkpoint should be left in its temporary folder"
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-checkpoint-00000006", "checkpoint-00000004"]
    assert check_checkpoints_complete(run).name == "checkpoint-00000004"

    # The previous checkpoint still loads...
    encoder, config, _ = load_run(run)
    assert config.name == "tiny" and config.output.keep_last == 1
    assert any(p.abs().sum() > 0 for p in encoder.parameters())
    # ...and resuming from it runs steps 5-12 and finishes with the uninterrupted run's weights.
    stdout, rows = _resume_here(run, tmp_path)
    check_resumed_exactly(stdout, rows, folder / "checkpoint-00000004", TOTAL, reference_run[1])
    assert [p.name for p in folder.iterdir()] == ["checkpoint-00000012"]  # stale temporary folders are cleaned
    _assert_identical(load_weights(run / "encoder"), reference)


@pytest.mark.parametrize("break_name,kill", [("delete_old_checkpoints_first", _kill_before_rename),
                                             ("remove_checkpoint_in_place", _kill_mid_removal)])
def test_rotation_check_fails_when_checkpoints_are_deleted_unsafely(recipe, tmp_path, break_name, kill):
    """Mutation tests (tests/README.md): deleting the old checkpoint before the new one is
    renamed into place, or deleting it under its own name, leaves the run without a complete
    checkpoint at the kill; :func:`check_checkpoints_complete` must report it."""
    run, marker = tmp_path / "run", tmp_path / "held"
    if kill is _kill_before_rename:
        kill(recipe, run, marker, 4, "--break", break_name)  # checkpoint-2 is gone before checkpoint-4 is in place
        failure = "no checkpoint left"
    else:
        kill(recipe, run, marker, "--break", break_name)  # checkpoint-2 half deleted, under its name
        failure = "checkpoint-00000002: files"
    with pytest.raises(AssertionError, match=failure):
        check_checkpoints_complete(run)


def _truncated_copy(full: Path, dest: Path, last_step: int) -> Path:
    """A copy of the finished run ``full`` as it was after the checkpoint of ``last_step``
    (later checkpoints and the encoder removed); returns that checkpoint."""
    shutil.copytree(full, dest)
    shutil.rmtree(dest / "encoder")
    (dest / "results.json").unlink()
    for ckpt in list_checkpoints(dest):
        if int(ckpt.name.split("-")[1]) > last_step:
            shutil.rmtree(ckpt)
    checkpoint = list_checkpoints(dest)[-1]
    assert checkpoint.name == f"checkpoint-{last_step:08d}"
    return checkpoint


@pytest.mark.parametrize("break_name,at", [("skip_restore", 6), ("forget_samples_seen", 10),
                                           ("skip_scheduler_restore", 10)])
def test_resume_checks_fail_when_the_restore_is_broken(reference_run, reference, tmp_path, break_name, at):
    """Mutation tests (tests/README.md): with ``load_checkpoint`` restoring nothing, the run
    restarts at step 0 and, with the same seed, still reaches the uninterrupted weights; with
    the samples-seen counter or the scheduler not restored, the steps run are the right ones.
    The guard of this file (:func:`check_resumed_exactly`) must report each (resuming in this
    process; the last two from the checkpoint of step 10: two steps to run are enough to show it)."""
    part = tmp_path / "part"
    checkpoint = _truncated_copy(reference_run[0], part, at)
    stdout, rows = _resume_here(part, tmp_path, "--break", break_name)
    failure = "resumed from" if break_name == "skip_restore" else f"step {at + 1}: resumed"
    with pytest.raises(AssertionError, match=failure):
        check_resumed_exactly(stdout, rows, checkpoint, TOTAL, reference_run[1])
    if break_name == "skip_restore":
        assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))  # the break did what it says: all 12 steps again
        _assert_identical(load_weights(part / "encoder"), reference)  # which the weights alone cannot show
    else:  # the right steps, the wrong counters
        assert [r["step"] for r in rows] == list(range(at + 1, TOTAL + 1))


def test_resume_mid_accumulation_window_with_loader_workers(tmp_path):
    """grad_accum_steps 2 over 5 batches per epoch (steps of 2, 2 and 1 micro-batches), one
    persistent loader worker, dropout and BatchNorm on. Killed after micro-batch 8 (the first
    half of step 5's window, whose gradients are lost), resumed from the checkpoint of step 4:
    it runs steps 5 and 6 only, with the uninterrupted counters, and ends with its weights.
    (The uninterrupted run and the resume run in this process, with their loader worker.)"""
    raw = tiny_config(num_samples=80, batch_size=16, epochs=2, dropout=0.1, batch_norm=True, text=False)
    raw["data"]["num_workers"] = 1
    raw["optimisation"]["grad_accum_steps"] = 2
    raw["output"].update(checkpoint_every=2, keep_last=10)
    recipe = write_recipe(tmp_path / "accum.yaml", raw)
    full = tmp_path / "full"
    _, reference_rows = train_recorded_in_process(tmp_path, str(recipe), "--output", str(full))
    assert _logged_steps(full) == [1, 2, 3, 4, 5, 6]
    assert [(r["epoch"], r["batch_in_epoch"]) for r in reference_rows[2:4]] == [(0, 5), (1, 2)]  # a short window

    run, marker = tmp_path / "run", tmp_path / "held"
    with started(_slow_train("--hold-after-micro-batch", "8", "--hold-marker", str(marker), "--", str(recipe),
                             "--output", str(run))) as proc:
        _kill_when_held(proc, marker, "micro-batch 8")
    checkpoint = list_checkpoints(run)[-1]
    assert checkpoint.name == "checkpoint-00000004" and _logged_steps(run)[-1] == 4
    stdout, rows = _resume_here(run, tmp_path)
    check_resumed_exactly(stdout, rows, checkpoint, 6, reference_rows)
    _assert_identical(load_weights(run / "encoder"), load_weights(full / "encoder"))


def test_resume_restores_stateful_objective(tmp_path):
    """IPMC with its memory bank, view filter (warm-up 1 epoch) and Wasserstein critic (own
    optimiser): resuming from a mid-run checkpoint restores all of it (same final weights).
    Both runs in this process."""
    raw = tiny_config(num_samples=64, batch_size=16, epochs=3, text=False)
    raw["objective"] = {"name": "ipmc", "params": {"beta": 0.1, "view_filter_k": 1, "warmup_epochs": 1,
                                                   "memory_bank_size": 64, "bank_negatives": 32, "critic_steps": 2}}
    raw["output"].update(checkpoint_every=3, keep_last=10)
    recipe = write_recipe(tmp_path / "ipmc.yaml", raw)
    full = tmp_path / "full"
    _, reference_rows = train_recorded_in_process(tmp_path, str(recipe), "--output", str(full))
    rows = list(csv.DictReader((full / "metrics.csv").open()))
    assert float(rows[-1]["moved_to_positive"]) > 0 and float(rows[-1]["critic_distance"]) != 0  # all tiers active

    # A copy of the run as it was at step 7 (mid-epoch 2: after the filter's warm-up).
    part = tmp_path / "part"
    checkpoint = _truncated_copy(full, part, 6)
    stdout, rows = _resume_here(part, tmp_path)
    check_resumed_exactly(stdout, rows, checkpoint, TOTAL, reference_rows)
    _assert_identical(load_weights(part / "encoder"), load_weights(full / "encoder"))


def test_resume_restores_ema_teacher(tmp_path):
    """An EMA teacher (ER's distillation form) is checkpointed as teacher.safetensors, not
    through Accelerate's pickled custom state: resuming mid-run gives the same final weights
    (the loss depends on the teacher, so a teacher not restored would change them). Both runs
    in this process."""
    raw = tiny_config(num_samples=64, batch_size=16, epochs=3, text=False)
    raw["objective"] = {"name": "er", "params": {"temperature": 0.2}, "ema_teacher": True, "teacher_momentum": 0.9}
    raw["output"].update(checkpoint_every=3, keep_last=10)
    recipe = write_recipe(tmp_path / "er.yaml", raw)
    full = tmp_path / "full"
    _, reference_rows = train_recorded_in_process(tmp_path, str(recipe), "--output", str(full))
    ckpt = list_checkpoints(full)[1]
    assert (ckpt / "teacher.safetensors").is_file() and not list(ckpt.glob("custom_checkpoint_*"))

    part = tmp_path / "part"
    checkpoint = _truncated_copy(full, part, 6)
    stdout, rows = _resume_here(part, tmp_path)
    check_resumed_exactly(stdout, rows, checkpoint, TOTAL, reference_rows)
    _assert_identical(load_weights(part / "encoder"), load_weights(full / "encoder"))


def test_wall_time_after_a_resume_counts_every_leg(tmp_path):
    """results.json's wall_time_s counted only the last leg of a resumed run. Each
    checkpoint records the run's wall time up to it; the resumed leg adds its own (here the
    first leg's record is raised to 10000 s, so that the sum is told from either leg alone)."""
    import time

    from mmviews.config import config_from_dict
    from mmviews.run import read_train_state
    from mmviews.train import train
    from mmviews.train.callbacks import TrainCallback

    class StopAfter(TrainCallback):
        def on_step_end(self, state):
            if state.step == 3:
                raise RuntimeError("stopped after step 3")

    raw = tiny_config(num_samples=32, batch_size=16, epochs=2, image=False, tasks=[])
    raw["output"].update(checkpoint_every=2, keep_last=2)
    config = config_from_dict(raw, "tiny.yaml")
    run = tmp_path / "run"
    begun = time.perf_counter()
    with pytest.raises(RuntimeError, match="stopped after step 3"):
        train(config, run, source="tiny.yaml", callback=StopAfter())
    first_leg = time.perf_counter() - begun
    (checkpoint,) = list_checkpoints(run)
    record = json.loads((checkpoint / "train_state.json").read_text())
    assert 0 < record["wall_time_s"] < first_leg and read_train_state(checkpoint)["wall_time_s"] == record["wall_time_s"]
    record["wall_time_s"] = 10000.0
    (checkpoint / "train_state.json").write_text(json.dumps(record))
    begun = time.perf_counter()
    summary = train(config, run, resume=run, source="tiny.yaml")
    second_leg = time.perf_counter() - begun
    assert 10000.0 < summary["wall_time_s"] < 10000.0 + second_leg
    assert json.loads((run / "results.json").read_text())["wall_time_s"] == pytest.approx(summary["wall_time_s"])
    assert "(every leg of the resumed run, each up to the checkpoint the next one resumed from)" in \
        (run / "report.md").read_text()
    # a checkpoint written after the resume goes on from the earlier legs' time
    assert read_train_state(list_checkpoints(run)[-1])["wall_time_s"] > 10000.0


@pytest.mark.parametrize("value", [-1.0, "12", True, float("nan")])
def test_a_wall_time_that_is_not_a_number_of_seconds_is_a_corrupt_checkpoint(tmp_path, value):
    from mmviews.data.safe_pickle import CorruptFileError
    from mmviews.run import read_train_state

    (tmp_path / "train_state.json").write_text(json.dumps({"epoch": 0, "batch_in_epoch": 0, "step": 2,
                                                           "wall_time_s": value}))
    with pytest.raises(CorruptFileError, match=r"key 'wall_time_s' must be a non-negative number of seconds"):
        read_train_state(tmp_path)
    (tmp_path / "train_state.json").write_text(json.dumps({"epoch": 0, "batch_in_epoch": 0, "step": 2}))
    assert read_train_state(tmp_path)["wall_time_s"] == 0.0  # a checkpoint from before it was recorded
