"""``python tests/slow_train.py [--step-sleep S] [--checkpoint-sleep S@STEP] -- TRAIN_ARGS...``:
``mmviews train TRAIN_ARGS`` with a callback that sleeps, so that a test can kill the run at
a chosen moment.

``--step-sleep S`` sleeps S seconds after every optimiser step; ``--checkpoint-sleep S@STEP``
sleeps S seconds once the checkpoint of optimiser step STEP is written to its temporary
folder, before it is renamed (``S`` alone: at every checkpoint).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mmviews.cli import train as train_command
from mmviews.train import TrainCallback, TrainState


class SleepCallback(TrainCallback):
    def __init__(self, step_sleep: float = 0.0, checkpoint_sleep: float = 0.0, checkpoint_step: int | None = None):
        self.step_sleep, self.checkpoint_sleep, self.checkpoint_step = step_sleep, checkpoint_sleep, checkpoint_step

    def on_step_end(self, state: TrainState) -> None:
        time.sleep(self.step_sleep)

    def on_checkpoint_written(self, state: TrainState, folder: Path) -> None:
        if self.checkpoint_step is None or state.step == self.checkpoint_step:
            time.sleep(self.checkpoint_sleep)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    ours = argparse.ArgumentParser(prog="slow_train")
    ours.add_argument("--step-sleep", type=float, default=0.0)
    ours.add_argument("--checkpoint-sleep", default="0", metavar="S[@STEP]")
    opts = ours.parse_args(argv[:split])
    seconds, _, step = opts.checkpoint_sleep.partition("@")
    callback = SleepCallback(opts.step_sleep, float(seconds), int(step) if step else None)
    parser = argparse.ArgumentParser(prog="mmviews train")
    train_command.add_arguments(parser)
    return train_command.run(parser.parse_args(argv[split + 1:]), callback=callback)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
