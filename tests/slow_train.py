"""``python tests/slow_train.py [OPTIONS] [--] TRAIN_ARGS...``: ``mmviews train TRAIN_ARGS`` with
a callback that records or holds, so that a test can see which optimiser steps a process ran,
with which counters, and kill or signal the run at a chosen moment. Also runs under
``accelerate launch tests/slow_train.py ...``.

``--record FILE`` appends one JSON line per optimiser step (rank 0 only): the loop's counters
after the step (``step``, ``epoch``, ``batch_in_epoch``, ``samples``) and the scheduler's
(``scheduler_step``, its ``last_epoch``; ``lr``, its last learning rates), read from the
prepared objects, so that a test compares a resumed process's steps with an uninterrupted one's.
``--marker FILE`` writes ``"<step> <pid>"`` to FILE (``FILE.rank<R>`` under a launcher with
several processes) after every optimiser step, atomically, so that a test knows which process
to signal. ``--hold-after-step N`` / ``--hold-after-checkpoint N`` / ``--hold-after-micro-batch N``
stop (sleep until killed) after optimiser step N (its callback, before its checkpoint), once the
checkpoint of step N is written to its temporary folder (before the rename), or after the N-th
micro-batch of this process (counted over epochs; mid accumulation window when
``grad_accum_steps`` > 1). ``--stop-self-after-checkpoint N`` stops the process (SIGSTOP) once the
checkpoint of step N is complete on every process (on ``--hold-rank`` only, when given). ``--hold-in-removal`` stops in the middle of the first folder
deletion of the run's ``checkpoints/`` (one file deleted, the rest not): a kill there is a
deletion cut short. ``--hold-marker FILE`` is created when a hold starts (``--checkpoint-hold-marker
FILE`` for the checkpoint hold, default the same), so the test waits for a file, not for a
time. ``--until-signal`` makes the step hold end at the first SIGINT/SIGTERM (after mmviews'
handler ran), so that the signal arrives at a known step; ``--hold-rank R`` holds on that rank
only (the others run on until they wait for it in a collective). ``--first-attempt-only``: no hold after torch's elastic agent restarted the workers
(``TORCHELASTIC_RESTART_COUNT`` > 0), so that a restarted run goes to its end. ``--stop-after-step N`` raises
:class:`StopAfterStep` after optimiser step N (for a run in the test's own process, see
:func:`install`, that needs no more steps). ``--break NAME`` applies a break of
``tests/mutations.py`` first (the tests that show a guard test fails).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from mutations import apply_break

import mmviews.train.trainer as trainer
from mmviews.cli import main as main_command
from mmviews.cli import train as train_command
from mmviews.run import CHECKPOINTS_DIR
from mmviews.train import TrainCallback, TrainState

Setter = Callable[[Any, str, Any], None]
HOLD_SECONDS = 600  # longer than any test waits: a held process ends because the test kills or signals it


class StopAfterStep(BaseException):
    """``--stop-after-step``: the run stops here (a BaseException: ``mmviews train``'s error
    handling lets it through to the caller)."""


def _write_marker(marker: str | None) -> None:
    if marker:
        Path(marker).write_text("held\n")


def _hold(marker: str | None) -> None:
    _write_marker(marker)
    time.sleep(HOLD_SECONDS)  # the test kills the process (SIGKILL) once the marker exists


def _hold_until_signal(marker: str | None) -> None:
    """Hold until the first SIGINT/SIGTERM: mmviews' own handler runs first (it records the
    request, or raises on a second signal), then the hold ends and the loop goes on at the same
    step. The marker is written after the handlers are in place, so no signal can be missed."""
    received: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)

    try:
        for s in previous:
            signal.signal(s, note)
        _write_marker(marker)
        deadline = time.monotonic() + HOLD_SECONDS
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)  # this process polls its own flag; the test waits for the marker
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _prepared_holder(set_attribute: Setter) -> list[Any]:
    """Wrap the trainer's ``prepare_run`` to keep the prepared objects (the scheduler) for --record."""
    holder: list[Any] = []
    prepare = trainer.prepare_run

    def keeping(*args: Any, **kwargs: Any) -> Any:
        holder.append(prepare(*args, **kwargs))
        return holder[-1]

    set_attribute(trainer, "prepare_run", keeping)
    return holder


class ControlCallback(TrainCallback):
    def __init__(self, opts: argparse.Namespace, prepared: list[Any]) -> None:
        self.opts, self.prepared = opts, prepared
        rank = int(os.environ.get("RANK", "0"))
        self.rank0 = rank == 0
        self.holds = opts.hold_rank is None or opts.hold_rank == rank
        if opts.first_attempt_only and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            self.holds = False
        self.marker = None
        if opts.marker is not None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.marker = Path(opts.marker if world == 1 else f"{opts.marker}.rank{rank}")

    def _record(self, state: TrainState) -> None:
        scheduler = self.prepared[-1].scheduler
        inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper
        row = {"step": state.step, "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
               "samples": state.samples, "scheduler_step": inner.last_epoch,
               "lr": [float(lr) for lr in scheduler.get_last_lr()]}
        with open(self.opts.record, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_step_end(self, state: TrainState) -> None:
        if self.opts.record and self.rank0:
            self._record(state)
        if self.marker is not None:
            tmp = self.marker.with_name(self.marker.name + ".tmp")
            tmp.write_text(f"{state.step} {os.getpid()}")
            os.replace(tmp, self.marker)
        if state.step == self.opts.stop_after_step:
            raise StopAfterStep(state.step)
        if state.step == self.opts.hold_after_step and self.holds:
            if self.opts.until_signal:
                _hold_until_signal(self.opts.hold_marker)
            else:
                _hold(self.opts.hold_marker)

    def on_checkpoint_written(self, state: TrainState, folder: Path) -> None:
        if state.step == self.opts.hold_after_checkpoint:
            _hold(self.opts.checkpoint_hold_marker or self.opts.hold_marker)


def _hold_after_micro_batch(n: int, marker: str | None, set_attribute: Setter) -> None:
    step, done = trainer.train_step, [0]

    def counting_step(*args, **kwargs):
        out = step(*args, **kwargs)
        done[0] += 1
        if done[0] == n:
            _hold(marker)
        return out

    set_attribute(trainer, "train_step", counting_step)


def _hold_in_removal(marker: str | None, set_attribute: Setter) -> None:
    """Hold in the middle of the first deletion of a folder under ``checkpoints/``: one of its
    files deleted, the others still there (``shutil.rmtree`` is looked up at each call, so
    mmviews' deletions, and a break's, come through here)."""
    rmtree = shutil.rmtree

    def rmtree_cut_short(path: Any, *args: Any, **kwargs: Any) -> None:
        folder = Path(path)
        if folder.parent.name == CHECKPOINTS_DIR and folder.is_dir():
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            if files:
                files[0].unlink()
                _hold(marker)
        rmtree(path, *args, **kwargs)

    set_attribute(shutil, "rmtree", rmtree_cut_short)


def _stop_self_after_checkpoint(step: int, rank: int | None, set_attribute: Setter) -> None:
    """SIGSTOP this process (on ``rank``, else any) once the checkpoint of ``step`` is complete on
    every process (``save_checkpoint`` has returned, after its last collective): a peer that hangs
    while the others are leaving."""
    save = trainer.save_checkpoint

    def save_then_stop(accelerator: Any, run_dir: Path, state: TrainState, *args: Any, **kwargs: Any) -> Any:
        saved = save(accelerator, run_dir, state, *args, **kwargs)
        if state.step == step and rank in (None, int(os.environ.get("RANK", "0"))):
            os.kill(os.getpid(), signal.SIGSTOP)
        return saved

    set_attribute(trainer, "save_checkpoint", save_then_stop)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(slow_train's options, ``mmviews train``'s arguments)."""
    ours = argparse.ArgumentParser(prog="slow_train")
    ours.add_argument("--record", default=None, metavar="FILE")
    ours.add_argument("--marker", default=None, metavar="FILE")
    ours.add_argument("--hold-after-step", type=int, default=None)
    ours.add_argument("--until-signal", action="store_true")
    ours.add_argument("--hold-rank", type=int, default=None)
    ours.add_argument("--first-attempt-only", action="store_true")
    ours.add_argument("--hold-after-checkpoint", type=int, default=None)
    ours.add_argument("--hold-after-micro-batch", type=int, default=None)
    ours.add_argument("--hold-in-removal", action="store_true")
    ours.add_argument("--stop-self-after-checkpoint", type=int, default=None)
    ours.add_argument("--hold-marker", default=None, metavar="FILE")
    ours.add_argument("--checkpoint-hold-marker", default=None, metavar="FILE")
    ours.add_argument("--stop-after-step", type=int, default=None)
    ours.add_argument("--break", dest="break_name", default=None)
    if "--" in argv:
        split = argv.index("--")
        return ours.parse_args(argv[:split]), argv[split + 1:]
    return ours.parse_known_args(argv)  # under accelerate launch, whose argument parser may drop a "--"


def install(opts: argparse.Namespace, set_attribute: Setter = setattr) -> None:
    """Apply the options to this process: the break, the holds and the callback given to
    ``mmviews train``. ``set_attribute``: ``setattr`` in the subprocess, pytest's
    ``monkeypatch.setattr`` for a run in the test's own process (undone after the test)."""
    if opts.break_name:
        apply_break(opts.break_name, set_attribute)
    if opts.hold_after_micro_batch is not None:
        _hold_after_micro_batch(opts.hold_after_micro_batch, opts.hold_marker, set_attribute)
    if opts.hold_in_removal:
        _hold_in_removal(opts.hold_marker, set_attribute)
    if opts.stop_self_after_checkpoint is not None:
        _stop_self_after_checkpoint(opts.stop_self_after_checkpoint, opts.hold_rank, set_attribute)
    callback = ControlCallback(opts, _prepared_holder(set_attribute))
    # Exactly `mmviews train TRAIN_ARGS` (its error and interrupt handling, exit status), with the callback.
    command = train_command.run
    set_attribute(train_command, "run", lambda args: command(args, callback=callback))


def main(argv: list[str]) -> int:
    opts, rest = parse(argv)
    install(opts)
    return main_command(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
