"""``mmviews.train.train``, the library's entry point: what it hands the run (the folder intent,
the options), how it turns a collective failure into mmviews's one line (and lets every other
error through unchanged), and the step bookkeeping of a real tiny run (the steps the callback
sees, the rows ``metrics.csv`` logs, the steps ``results.json`` counts)."""

from __future__ import annotations

import csv
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from test_train_utils import own_accelerate_state, tiny_config, write_recipe

import mmviews.train.trainer as trainer
from mmviews.config import load_config
from mmviews.train.callbacks import TrainCallback
from mmviews.train.interrupt import TrainingInterrupted
from mmviews.train.run_folder import Intent
from mmviews.train.state import TrainState

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to complete"


@pytest.fixture
def config(tmp_path: Path) -> Any:
    return load_config(write_recipe(tmp_path / "r.yaml", tiny_config(num_samples=32, image=False)))


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``train`` hands to the run (the run itself replaced by a recorder)."""
    seen: dict[str, Any] = {}

    def fake_train(config, run_dir, intent, source, callback, stop, on_exit, **options):
        seen.update(run_dir=run_dir, intent=intent, source=source, callback=callback, **options)
        return {"status": "ok"}

    monkeypatch.setattr(trainer, "_train", fake_train)
    return seen


def test_a_fresh_run_asks_to_start_with_the_recipe_given(config, seen, tmp_path: Path) -> None:
    assert trainer.train(config, str(tmp_path / "run")) == {"status": "ok"}
    assert seen["run_dir"] == tmp_path / "run" and isinstance(seen["run_dir"], Path)
    assert seen["intent"] == Intent(resume=None, overwrite=False, recipe_given=True)
    assert seen["source"] == "recipe" and type(seen["callback"]) is TrainCallback
    assert seen["resume_ignore_rng"] is False and seen["reevaluate"] is False and seen["progress"] == []


def test_a_resume_carries_its_folder_and_whether_the_recipe_came_from_the_caller(config, seen, tmp_path: Path) -> None:
    callback = TrainCallback()
    trainer.train(config, tmp_path / "run", resume=str(tmp_path / "run"), source="api", callback=callback,
                  resume_ignore_rng=True, reevaluate=True)
    assert seen["intent"] == Intent(resume=tmp_path / "run", overwrite=False, recipe_given=False)
    assert isinstance(seen["intent"].resume, Path)
    assert seen["source"] == "api" and seen["callback"] is callback
    assert seen["resume_ignore_rng"] is True and seen["reevaluate"] is True
    trainer.train(config, tmp_path / "run", resume=tmp_path / "run", recipe_given=True)
    assert seen["intent"] == Intent(resume=tmp_path / "run", overwrite=False, recipe_given=True)
    trainer.train(config, tmp_path / "run", overwrite=True)
    assert seen["intent"] == Intent(resume=None, overwrite=True, recipe_given=True)


def _failing_run(monkeypatch: pytest.MonkeyPatch, error: BaseException, steps: list[int]) -> None:
    def fake_train(config, run_dir, intent, source, callback, stop, on_exit, *, progress, **options):
        progress.extend(TrainState(step=s) for s in steps)
        raise error

    monkeypatch.setattr(trainer, "_train", fake_train)


def _checkpoints(run: Path, *steps: int) -> list[Path]:
    folders = [run / "checkpoints" / f"checkpoint-{s:08d}" for s in steps]
    for folder in folders:
        folder.mkdir(parents=True)
    return folders


def test_a_collective_timeout_becomes_one_line_naming_the_step_and_the_newest_checkpoint(
        config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    run = tmp_path / "run"
    newest = _checkpoints(run, 2, 10, 4)[1]  # checkpoint-00000010 is the newest, by step not by name order
    error = RuntimeError(GLOO_TIMEOUT)
    _failing_run(monkeypatch, error, [1, 2, 7])
    config.distributed.timeout_s = 3
    with pytest.raises(Exception) as raised:
        trainer.train(config, run)
    assert raised.value.__cause__ is error
    assert str(raised.value) == (
        "process 0 of 1 stopped after step 7: it waited more than distributed.timeout_s = 3 s for the other "
        f"processes in a collective (one of them hung, was stopped, or died); newest complete checkpoint: {newest}")


def test_a_collective_failure_before_any_step_or_checkpoint_says_so(config, monkeypatch, tmp_path: Path) -> None:
    _failing_run(monkeypatch, RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection "
                                           "closed by peer [127.0.0.1]:63175"), [])
    with pytest.raises(Exception) as raised:
        trainer.train(config, tmp_path / "run")
    assert "another process left (it died or was killed); no checkpoint yet" in str(raised.value)
    assert "after step" not in str(raised.value)


def test_any_other_error_passes_through_unchanged(config, monkeypatch, tmp_path: Path) -> None:
    error = ValueError("a file that cannot be read")
    _failing_run(monkeypatch, error, [3])
    _checkpoints(tmp_path / "run", 3)
    with pytest.raises(ValueError) as raised:
        trainer.train(config, tmp_path / "run")
    assert raised.value is error


class _Steps(TrainCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, state: TrainState) -> None:
        self.steps.append(state.step)


def _tiny_run_config(tmp_path: Path, **optimisation: Any) -> Any:
    recipe = tiny_config(num_samples=32, batch_size=16, epochs=3, image=False, tasks=[])
    recipe["output"].update(log_every=4, checkpoint_every=0)
    recipe["evaluation"] = {"tasks": [], "random_baseline": False}
    recipe["objective"] = {"name": "geometric_pvc", "params": {"temperature": 0.2}}  # logs the poly-view MI bound
    recipe["optimisation"].update(optimisation)
    return load_config(write_recipe(tmp_path / "r.yaml", recipe))


def test_a_real_run_counts_its_steps_logs_every_log_every_and_the_last(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """32 samples, K = 16, 3 epochs: 6 optimiser steps; log_every 4 logs steps 4 and 6 (the last),
    each row with the poly-view bound of its batch's K and M; the losses are checked for NaN at
    the log steps (and before every checkpoint), the message to name the log interval."""
    config = _tiny_run_config(tmp_path)
    checked: list[tuple[int, int]] = []
    check_losses = trainer._check_losses
    monkeypatch.setattr(trainer, "_check_losses",
                        lambda p, state, log_every: (checked.append((state.step, log_every)), check_losses(p, state, log_every)))
    callback = _Steps()
    with own_accelerate_state():
        summary = trainer.train(config, tmp_path / "run", callback=callback)
    assert callback.steps == [1, 2, 3, 4, 5, 6]
    # at the log steps 4 and 6, and before each epoch's checkpoint (steps 2, 4, 6)
    assert checked == [(2, 4), (4, 4), (4, 4), (6, 4), (6, 4)]
    assert summary["steps"] == 6 and summary["epochs"] == 3
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [4, 6]
    K, M = 16, 3  # the text view and its two augmented copies
    for r in rows:  # the bound of each logged step's batch: log(K M - M + 1) - loss
        assert float(r["mi_lower_bound"]) == pytest.approx(math.log(K * M - M + 1) - float(r["loss"]), abs=1e-4)


def test_a_programs_run_sets_up_its_process_from_the_recipe(config, monkeypatch: pytest.MonkeyPatch) -> None:
    """Called from a program (not the ``mmviews`` command): the recipe's determinism, its host
    memory setting applied as a library call that does not own the process (an explicit setting
    only), on the CPU when the steps run there, and the launch checked against the processes
    Accelerate really started."""
    calls: dict[str, Any] = {}
    monkeypatch.setattr(trainer, "configure_determinism", lambda on: calls.setdefault("deterministic", on))
    monkeypatch.setattr(trainer, "configure_host_memory",
                        lambda setting, **kw: calls.setdefault("host_memory", (setting, kw)))
    monkeypatch.setattr(trainer, "check_launch", lambda n, cfg: calls.setdefault("launch", (n, cfg)))
    config.deterministic = True
    with own_accelerate_state():
        started = trainer._start_processes(config).num_processes
    assert calls["deterministic"] is True
    assert calls["host_memory"] == (config.host_memory, {"owns_process": False, "on_cpu": True})
    assert calls["launch"] == (started, config) and started == 1


def test_max_steps_ends_the_run_inside_an_epoch(tmp_path: Path) -> None:
    """``optimisation.max_steps`` 3 of 2 batches an epoch: the run stops after the first batch of
    its second epoch, not at the epoch's end."""
    callback = _Steps()
    with own_accelerate_state():
        summary = trainer.train(_tiny_run_config(tmp_path, max_steps=3), tmp_path / "run", callback=callback)
    assert callback.steps == [1, 2, 3] and summary["steps"] == 3


class _SignalAt(_Steps):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_step_end(self, state: TrainState) -> None:
        super().on_step_end(state)
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_stops_the_run_after_the_step_it_came_in(tmp_path: Path) -> None:
    callback = _SignalAt(2)
    with own_accelerate_state(), pytest.raises(TrainingInterrupted) as stopped:
        trainer.train(_tiny_run_config(tmp_path), tmp_path / "run", callback=callback)
    assert callback.steps == [1, 2] and stopped.value.step == 2
