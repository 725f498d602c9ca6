"""Kill `mmviews train` with SIGKILL (at a random step, and while a checkpoint is being
written), resume, and finish with weights identical to an uninterrupted run."""

from __future__ import annotations

import csv
import os
import random
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

# 4 batches per epoch x 3 epochs = 12 optimiser steps, a checkpoint every 2 steps. Dropout
# and BatchNorm are on, so equality also needs the RNG states and BN buffers restored.
CONFIG = tiny_config(num_samples=64, batch_size=16, epochs=3, dropout=0.1, batch_norm=True)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory) -> dict[str, torch.Tensor]:
    run = tmp_path_factory.mktemp("ref") / "run"
    r = run_train(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return load_weights(run / "encoder")


def _last_step(log: Path) -> int:
    try:
        rows = list(csv.DictReader(log.open()))
    except FileNotFoundError:
        return 0
    return int(rows[-1]["step"]) if rows else 0


def _start(recipe: Path, run: Path, *sleep_options: str) -> subprocess.Popen:
    """``mmviews train RECIPE --output RUN`` in a subprocess, slowed down by the sleeping
    callback of ``tests/slow_train.py`` (``--step-sleep S``, ``--checkpoint-sleep S@STEP``)."""
    command = [sys.executable, str(SLOW_TRAIN), *sleep_options, "--", str(recipe), "--output", str(run)]
    return subprocess.Popen(command, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen, condition, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"training ended (rc {proc.returncode}) before it could be killed: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the moment to kill")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


def test_sigkill_at_random_step_then_resume_is_identical(recipe, reference, tmp_path):
    kill_at = random.randint(3, 10)  # printed by pytest on failure
    run = tmp_path / "run"
    proc = _start(recipe, run, "--step-sleep", "0.25")
    _kill_when(proc, lambda: _last_step(run / "metrics.csv") >= kill_at)
    assert not (run / "encoder").exists(), "the run finished before the kill"
    done = _last_step(run / "metrics.csv")
    ckpt = list_checkpoints(run)[-1]
    assert int(ckpt.name.split("-")[1]) <= done < 12

    r = run_train("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_identical(load_weights(run / "encoder"), reference)
    # The log continues from the checkpoint without duplicated steps.
    assert [int(row["step"]) for row in csv.DictReader((run / "metrics.csv").open())] == list(range(1, 13))


def test_kill_while_writing_checkpoint_keeps_previous_one(recipe, reference, tmp_path):
    run = tmp_path / "run"
    # Sleep for a long time once the checkpoint of step 6 (mid-epoch 2) is written to its
    # temporary folder, before the rename.
    proc = _start(recipe, run, "--checkpoint-sleep", "60@6")
    tmp = run / "checkpoints" / ".tmp-checkpoint-00000006"
    _kill_when(proc, lambda: (tmp / "train_state.json").exists() or (tmp.is_dir() and any(tmp.glob("*.safetensors"))))
    assert tmp.is_dir(), "the half-written checkpoint should be left in its temporary folder"
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint-00000002", "checkpoint-00000004"]

    # The previous checkpoint still loads...
    encoder, config, _ = load_run(run)
    assert config.name == "tiny"
    assert any(p.abs().sum() > 0 for p in encoder.parameters())
    # ...and resuming from it finishes with the uninterrupted run's weights.
    r = run_train("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not tmp.exists()  # stale temporary folders are cleaned on start
    _assert_identical(load_weights(run / "encoder"), reference)


def test_resume_restores_stateful_objective(tmp_path):
    """IPMC with its memory bank, view filter (warm-up 1 epoch) and Wasserstein critic (own
    optimiser): resuming from a mid-run checkpoint restores all of it (same final weights)."""
    import shutil

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
    shutil.copytree(full, part)
    shutil.rmtree(part / "encoder")
    for ckpt in list_checkpoints(part):
        if int(ckpt.name.split("-")[1]) > 7:
            shutil.rmtree(ckpt)
    assert list_checkpoints(part)[-1].name == "checkpoint-00000006"
    r = run_train("--resume", str(part))
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_identical(load_weights(part / "encoder"), load_weights(full / "encoder"))


def test_resume_restores_ema_teacher(tmp_path):
    """An EMA teacher (ER's distillation form) is checkpointed as teacher.safetensors, not
    through Accelerate's pickled custom state: resuming mid-run gives the same final weights
    (the loss depends on the teacher, so a teacher not restored would change them)."""
    import shutil

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
    shutil.copytree(full, part)
    shutil.rmtree(part / "encoder")
    for ckpt in list_checkpoints(part):
        if int(ckpt.name.split("-")[1]) > 6:
            shutil.rmtree(ckpt)
    assert list_checkpoints(part)[-1].name == "checkpoint-00000006"
    r = run_train("--resume", str(part))
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_identical(load_weights(part / "encoder"), load_weights(full / "encoder"))
