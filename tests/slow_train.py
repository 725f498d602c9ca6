"""``python tests/slow_train.py [--step-sleep S] [--checkpoint-sleep S@STEP] [--marker FILE] -- TRAIN_ARGS...``:
``mmviews train TRAIN_ARGS`` with a callback that sleeps, so that a test can kill the run at
a chosen moment.

``--step-sleep S`` sleeps S seconds after every optimiser step; ``--checkpoint-sleep S@STEP``
sleeps S seconds once the checkpoint of optimiser step STEP is written to its temporary
folder, before it is renamed (``S`` alone: at every checkpoint). ``--marker FILE`` writes
``"<step> <pid>"`` to FILE (``FILE.rank<R>`` under a launcher with several processes) after
every optimiser step, atomically, so that a test knows when training runs and which process
to signal. Also runs under ``accelerate launch tests/slow_train.py ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from mmviews.cli import main as main_command
from mmviews.cli import train as train_command
from mmviews.train import TrainCallback, TrainState


class SleepCallback(TrainCallback):
    def __init__(self, step_sleep: float = 0.0, checkpoint_sleep: float = 0.0, checkpoint_step: int | None = None,
                 marker: str | None = None):
        self.step_sleep, self.checkpoint_sleep, self.checkpoint_step = step_sleep, checkpoint_sleep, checkpoint_step
        self.marker = None
        if marker is not None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.marker = Path(marker if world == 1 else f"{marker}.rank{os.environ['RANK']}")

    def on_step_end(self, state: TrainState) -> None:
        if self.marker is not None:
            tmp = self.marker.with_name(self.marker.name + ".tmp")
            tmp.write_text(f"{state.step} {os.getpid()}")
            os.replace(tmp, self.marker)
        time.sleep(self.step_sleep)

    def on_checkpoint_written(self, state: TrainState, folder: Path) -> None:
        if self.checkpoint_step is None or state.step == self.checkpoint_step:
            time.sleep(self.checkpoint_sleep)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    ours = argparse.ArgumentParser(prog="slow_train")
    ours.add_argument("--step-sleep", type=float, default=0.0)
    ours.add_argument("--checkpoint-sleep", default="0", metavar="S[@STEP]")
    ours.add_argument("--marker", default=None, metavar="FILE")
    opts = ours.parse_args(argv[:split])
    seconds, _, step = opts.checkpoint_sleep.partition("@")
    callback = SleepCallback(opts.step_sleep, float(seconds), int(step) if step else None, opts.marker)
    # Exactly `mmviews train TRAIN_ARGS` (its error and interrupt handling, exit status), with the callback.
    command = train_command.run
    train_command.run = lambda args: command(args, callback=callback)
    return main_command(["train", *argv[split + 1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
