"""``python tests/slow_train.py [OPTIONS] [--] TRAIN_ARGS...``: ``mmviews train TRAIN_ARGS`` with
a callback that records, sleeps or holds, so that a test can see which optimiser steps a
process ran and kill or signal the run at a chosen moment. Also runs under
``accelerate launch tests/slow_train.py ...``.

``--record FILE`` appends each optimiser step's number to FILE, one a line (rank 0 only).
``--marker FILE`` writes ``"<step> <pid>"`` to FILE (``FILE.rank<R>`` under a launcher with
several processes) after every optimiser step, atomically, so that a test knows when training
runs and which process to signal. ``--hold-after-step N`` / ``--hold-after-checkpoint N`` /
``--hold-after-micro-batch N`` stop (sleep until killed) after optimiser step N (its callback,
before its checkpoint), once the checkpoint of step N is written to its temporary folder (before
the rename), or after the N-th micro-batch of this process (counted over epochs; mid
accumulation window when ``grad_accum_steps`` > 1); ``--hold-marker FILE`` is created when the
hold starts, so the test waits for a file, not for a time. ``--step-sleep S`` sleeps S seconds
after every optimiser step; ``--checkpoint-sleep S@STEP`` sleeps S seconds once the checkpoint
of STEP is written (``S`` alone: at every checkpoint). ``--break NAME`` applies a break of
``tests/mutations.py`` first (the tests that show a guard test fails).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from mutations import apply_break

import mmviews.train.trainer as trainer
from mmviews.cli import main as main_command
from mmviews.cli import train as train_command
from mmviews.train import TrainCallback, TrainState


def _hold(marker: str | None) -> None:
    if marker:
        Path(marker).write_text("held\n")
    time.sleep(600)  # the test kills the process (SIGKILL) once the marker exists


class ControlCallback(TrainCallback):
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        seconds, _, step = opts.checkpoint_sleep.partition("@")
        self.checkpoint_sleep, self.checkpoint_step = float(seconds), int(step) if step else None
        self.rank0 = int(os.environ.get("RANK", "0")) == 0
        self.marker = None
        if opts.marker is not None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.marker = Path(opts.marker if world == 1 else f"{opts.marker}.rank{os.environ['RANK']}")

    def on_step_end(self, state: TrainState) -> None:
        if self.opts.record and self.rank0:
            with open(self.opts.record, "a") as f:
                f.write(f"{state.step}\n")
        if self.marker is not None:
            tmp = self.marker.with_name(self.marker.name + ".tmp")
            tmp.write_text(f"{state.step} {os.getpid()}")
            os.replace(tmp, self.marker)
        time.sleep(self.opts.step_sleep)
        if state.step == self.opts.hold_after_step:
            _hold(self.opts.hold_marker)

    def on_checkpoint_written(self, state: TrainState, folder: Path) -> None:
        if self.checkpoint_step is None or state.step == self.checkpoint_step:
            time.sleep(self.checkpoint_sleep)
        if state.step == self.opts.hold_after_checkpoint:
            _hold(self.opts.hold_marker)


def _hold_after_micro_batch(n: int, marker: str | None) -> None:
    step, done = trainer.train_step, [0]

    def counting_step(*args, **kwargs):
        out = step(*args, **kwargs)
        done[0] += 1
        if done[0] == n:
            _hold(marker)
        return out

    trainer.train_step = counting_step


def main(argv: list[str]) -> int:
    ours = argparse.ArgumentParser(prog="slow_train")
    ours.add_argument("--record", default=None, metavar="FILE")
    ours.add_argument("--marker", default=None, metavar="FILE")
    ours.add_argument("--hold-after-step", type=int, default=None)
    ours.add_argument("--hold-after-checkpoint", type=int, default=None)
    ours.add_argument("--hold-after-micro-batch", type=int, default=None)
    ours.add_argument("--hold-marker", default=None, metavar="FILE")
    ours.add_argument("--step-sleep", type=float, default=0.0)
    ours.add_argument("--checkpoint-sleep", default="0", metavar="S[@STEP]")
    ours.add_argument("--break", dest="break_name", default=None)
    if "--" in argv:
        split = argv.index("--")
        opts, rest = ours.parse_args(argv[:split]), argv[split + 1:]
    else:  # under accelerate launch, whose argument parser may drop a "--"
        opts, rest = ours.parse_known_args(argv)
    if opts.break_name:
        apply_break(opts.break_name)
    if opts.hold_after_micro_batch is not None:
        _hold_after_micro_batch(opts.hold_after_micro_batch, opts.hold_marker)
    callback = ControlCallback(opts)
    # Exactly `mmviews train TRAIN_ARGS` (its error and interrupt handling, exit status), with the callback.
    command = train_command.run
    train_command.run = lambda args: command(args, callback=callback)
    return main_command(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
