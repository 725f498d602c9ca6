"""Kill `mmviews train` with SIGKILL (mid-run, mid accumulation window, and while a checkpoint
is being written), resume, and check that the resumed process runs exactly the optimiser steps
after the checkpoint (counted by the callback of ``tests/slow_train.py``), says where it
continues, and finishes with weights identical to an uninterrupted run.

Weights alone cannot show a resume: a run that silently restarts at step 0 with the same seed
reaches the same weights. The step count and the ``resumed from`` line can, and
:func:`test_resume_checks_fail_when_nothing_is_restored` shows they do."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_utils import REPO, env, load_weights, run_train, tiny_config, write_recipe

from mmviews.run import list_checkpoints, load_run

SLOW_TRAIN = Path(__file__).resolve().parent / "slow_train.py"

# 4 batches per epoch x 3 epochs = 12 optimiser steps, a checkpoint every 2 steps (all kept).
# Dropout and BatchNorm are on, so equality also needs the RNG states and BN buffers restored.
CONFIG = tiny_config(num_samples=64, batch_size=16, epochs=3, dropout=0.1, batch_norm=True)
CONFIG["output"]["keep_last"] = 10
TOTAL = 12


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


@pytest.fixture(scope="module")
def reference_run(recipe, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    r = run_train(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[str, torch.Tensor]:
    return load_weights(reference_run / "encoder")


def _logged_steps(run: Path) -> list[int]:
    return [int(row["step"]) for row in csv.DictReader((run / "metrics.csv").open())]


def _start(*options: str) -> subprocess.Popen:
    """``tests/slow_train.py OPTIONS`` (its own options, ``--``, then ``mmviews train``'s) in a subprocess."""
    command = [sys.executable, str(SLOW_TRAIN), *options]
    return subprocess.Popen(command, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_when_held(proc: subprocess.Popen, marker: Path, what: str, timeout: float = 180) -> None:
    """SIGKILL ``proc`` once it holds at the chosen point (``slow_train`` writes ``marker`` and
    then sleeps: the process is stopped there when the marker exists, whatever the timing)."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"training ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def _resume(run: Path, tmp_path: Path, *options: str) -> tuple[str, list[int]]:
    """``mmviews train --resume RUN`` through ``slow_train --record``: (stdout, optimiser steps this process ran)."""
    record = tmp_path / f"steps-{len(list(tmp_path.glob('steps-*')))}.txt"
    r = subprocess.run([sys.executable, str(SLOW_TRAIN), "--record", str(record), *options, "--", "--resume", str(run)],
                       capture_output=True, text=True, timeout=180, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [int(line) for line in record.read_text().split()] if record.exists() else []
    return r.stdout, steps


def check_resumed_exactly(stdout: str, steps: list[int], checkpoint: Path, total: int) -> None:
    """The guard of "resume == uninterrupted" beyond the weights: the process said where it
    continued, and ran exactly the optimiser steps after ``checkpoint``, each once."""
    at = int(checkpoint.name.split("-")[1])
    line = f"resumed from {checkpoint} at step {at} of {total}"
    assert [ln for ln in stdout.splitlines() if ln.startswith("resumed from")] == [line], stdout[-2000:]
    assert steps == list(range(at + 1, total + 1)), f"resumed from step {at}, ran steps {steps}"


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


def test_sigkill_mid_run_then_resume_runs_only_the_remaining_steps(recipe, reference, tmp_path):
    kill_after = 7  # mid-epoch 2, one step past the checkpoint of step 6: that step is redone
    run, marker = tmp_path / "run", tmp_path / "held"
    proc = _start("--hold-after-step", str(kill_after), "--hold-marker", str(marker), "--",
                  str(recipe), "--output", str(run))
    _kill_when_held(proc, marker, f"step {kill_after}")
    assert not (run / "encoder").exists(), "the run finished before the kill"
    assert _logged_steps(run)[-1] == kill_after
    checkpoint = list_checkpoints(run)[-1]
    assert checkpoint.name == "checkpoint-00000006", [c.name for c in list_checkpoints(run)]

    stdout, steps = _resume(run, tmp_path)
    check_resumed_exactly(stdout, steps, checkpoint, TOTAL)
    _assert_identical(load_weights(run / "encoder"), reference)
    # The log continues from the checkpoint without duplicated steps (step 7 is logged once).
    assert _logged_steps(run) == list(range(1, TOTAL + 1))


def test_kill_while_writing_checkpoint_keeps_previous_one(recipe, reference, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "held"
    # Stop once the checkpoint of step 6 (mid-epoch 2) is written to its temporary folder,
    # before the rename.
    proc = _start("--hold-after-checkpoint", "6", "--hold-marker", str(marker), "--", str(recipe), "--output", str(run))
    _kill_when_held(proc, marker, "the checkpoint of step 6")
    tmp = run / "checkpoints" / ".tmp-checkpoint-00000006"
    assert tmp.is_dir(), "the half-written checkpoint should be left in its temporary folder"
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint-00000002", "checkpoint-00000004"]

    # The previous checkpoint still loads...
    encoder, config, _ = load_run(run)
    assert config.name == "tiny"
    assert any(p.abs().sum() > 0 for p in encoder.parameters())
    # ...and resuming from it runs steps 5-12 and finishes with the uninterrupted run's weights.
    stdout, steps = _resume(run, tmp_path)
    check_resumed_exactly(stdout, steps, run / "checkpoints" / "checkpoint-00000004", TOTAL)
    assert not tmp.exists()  # stale temporary folders are cleaned on start
    _assert_identical(load_weights(run / "encoder"), reference)


def _truncated_copy(full: Path, dest: Path, last_step: int) -> Path:
    """A copy of the finished run ``full`` as it was after the checkpoint of ``last_step``
    (later checkpoints and the encoder removed); returns that checkpoint."""
    shutil.copytree(full, dest)
    shutil.rmtree(dest / "encoder")
    for ckpt in list_checkpoints(dest):
        if int(ckpt.name.split("-")[1]) > last_step:
            shutil.rmtree(ckpt)
    checkpoint = list_checkpoints(dest)[-1]
    assert checkpoint.name == f"checkpoint-{last_step:08d}"
    return checkpoint


def test_resume_checks_fail_when_nothing_is_restored(reference_run, reference, tmp_path):
    """Mutation test (tests/README.md): with ``load_checkpoint`` restoring nothing, the run
    restarts at step 0 and, with the same seed, still reaches the uninterrupted weights; the
    guard of this file (:func:`check_resumed_exactly`) must report it."""
    part = tmp_path / "part"
    checkpoint = _truncated_copy(reference_run, part, 6)
    stdout, steps = _resume(part, tmp_path, "--break", "skip_restore")
    with pytest.raises(AssertionError):
        check_resumed_exactly(stdout, steps, checkpoint, TOTAL)
    assert steps == list(range(1, TOTAL + 1))  # the break did what it says: all 12 steps again
    _assert_identical(load_weights(part / "encoder"), reference)  # which the weights alone cannot show


def test_resume_mid_accumulation_window_with_loader_workers(tmp_path):
    """grad_accum_steps 2 over 5 batches per epoch (steps of 2, 2 and 1 micro-batches), one
    persistent loader worker, dropout and BatchNorm on. Killed after micro-batch 8 (the first
    half of step 5's window, whose gradients are lost), resumed from the checkpoint of step 4:
    it runs steps 5 and 6 only and ends with the uninterrupted weights."""
    raw = tiny_config(num_samples=80, batch_size=16, epochs=2, dropout=0.1, batch_norm=True)
    raw["data"]["num_workers"] = 1
    raw["optimisation"]["grad_accum_steps"] = 2
    raw["output"].update(checkpoint_every=2, keep_last=10)
    recipe = write_recipe(tmp_path / "accum.yaml", raw)
    full = tmp_path / "full"
    r = run_train(str(recipe), "--output", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _logged_steps(full) == [1, 2, 3, 4, 5, 6]

    run, marker = tmp_path / "run", tmp_path / "held"
    proc = _start("--hold-after-micro-batch", "8", "--hold-marker", str(marker), "--", str(recipe), "--output", str(run))
    _kill_when_held(proc, marker, "micro-batch 8")
    checkpoint = list_checkpoints(run)[-1]
    assert checkpoint.name == "checkpoint-00000004" and _logged_steps(run)[-1] == 4
    stdout, steps = _resume(run, tmp_path)
    check_resumed_exactly(stdout, steps, checkpoint, 6)
    _assert_identical(load_weights(run / "encoder"), load_weights(full / "encoder"))


def test_resume_restores_stateful_objective(tmp_path):
    """IPMC with its memory bank, view filter (warm-up 1 epoch) and Wasserstein critic (own
    optimiser): resuming from a mid-run checkpoint restores all of it (same final weights)."""
    raw = tiny_config(num_samples=64, batch_size=16, epochs=3)
    raw["objective"] = {"name": "ipmc", "params": {"beta": 0.1, "view_filter_k": 1, "warmup_epochs": 1,
                                                   "memory_bank_size": 64, "bank_negatives": 32, "critic_steps": 2}}
    raw["output"].update(checkpoint_every=3, keep_last=10)
    recipe = write_recipe(tmp_path / "ipmc.yaml", raw)
    full = tmp_path / "full"
    r = run_train(str(recipe), "--output", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader((full / "metrics.csv").open()))
    assert float(rows[-1]["moved_to_positive"]) > 0 and float(rows[-1]["critic_distance"]) != 0  # all tiers active

    # A copy of the run as it was at step 7 (mid-epoch 2: after the filter's warm-up).
    part = tmp_path / "part"
    checkpoint = _truncated_copy(full, part, 6)
    stdout, steps = _resume(part, tmp_path)
    check_resumed_exactly(stdout, steps, checkpoint, TOTAL)
    _assert_identical(load_weights(part / "encoder"), load_weights(full / "encoder"))


def test_resume_restores_ema_teacher(tmp_path):
    """An EMA teacher (ER's distillation form) is checkpointed as teacher.safetensors, not
    through Accelerate's pickled custom state: resuming mid-run gives the same final weights
    (the loss depends on the teacher, so a teacher not restored would change them)."""
    raw = tiny_config(num_samples=64, batch_size=16, epochs=3)
    raw["objective"] = {"name": "er", "params": {"temperature": 0.2}, "ema_teacher": True, "teacher_momentum": 0.9}
    raw["output"].update(checkpoint_every=3, keep_last=10)
    recipe = write_recipe(tmp_path / "er.yaml", raw)
    full = tmp_path / "full"
    r = run_train(str(recipe), "--output", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = list_checkpoints(full)[1]
    assert (ckpt / "teacher.safetensors").is_file() and not list(ckpt.glob("custom_checkpoint_*"))

    part = tmp_path / "part"
    checkpoint = _truncated_copy(full, part, 6)
    stdout, steps = _resume(part, tmp_path)
    check_resumed_exactly(stdout, steps, checkpoint, TOTAL)
    _assert_identical(load_weights(part / "encoder"), load_weights(full / "encoder"))
