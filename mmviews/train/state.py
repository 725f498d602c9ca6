"""The run's state: where the loop is (:class:`TrainState`), the data a checkpoint saves and a
resume restores.

It sits below the modules that read or write it: the loop (:mod:`mmviews.train.trainer`), the
step (:mod:`mmviews.train.step`), callbacks (:mod:`mmviews.train.callbacks`), checkpoints
(:mod:`mmviews.train.checkpoint`) and logging (:mod:`mmviews.train.step_log`); it imports none
of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainState:
    """Where the loop is; saved in every checkpoint. ``batch_in_epoch`` counts the
    micro-batches of ``epoch`` already trained on; ``step`` the optimiser steps; ``samples``
    the samples seen (global, over all processes)."""

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    samples: int = 0
    # A streamed run's loader (mmviews.data.streaming.StreamLoader): its state_dict (JSON data) is
    # saved as "stream"; a loaded one waits in stream_state for the trainer to hand it back.
    stream: Any = None
    stream_state: dict[str, Any] | None = None
    # Wall time: the seconds the run's earlier legs took up to the checkpoint this leg resumed
    # from (0 for a fresh run), and when this leg started (time.perf_counter(); None: not started)
    earlier_wall_time_s: float = 0.0
    leg_started: float | None = None

    @property
    def wall_time_s(self) -> float:
        """The run's wall time so far, every leg counted: the earlier legs' up to the checkpoint
        each resume started from (the time between that checkpoint and a crash is lost), and this one's."""
        leg = 0.0 if self.leg_started is None else time.perf_counter() - self.leg_started
        return self.earlier_wall_time_s + leg

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "step": self.step,
                                 "samples": self.samples, "wall_time_s": round(self.wall_time_s, 3)}
        if self.stream is not None:
            state["stream"] = self.stream.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.step, self.samples = int(state["step"]), int(state.get("samples", 0))
        self.earlier_wall_time_s = float(state.get("wall_time_s", 0.0))  # 0 in checkpoints from before it was kept
        self.stream_state = state.get("stream")
