"""The run's state: where the loop is (:class:`TrainState`), the data a checkpoint saves and a
resume restores.

It sits below the modules that read or write it: the loop (:mod:`mmviews.train.trainer`), the
step (:mod:`mmviews.train.step`), callbacks (:mod:`mmviews.train.callbacks`), checkpoints
(:mod:`mmviews.train.checkpoint`) and logging (:mod:`mmviews.train.step_log`); it imports none
of them.
"""

from __future__ import annotations

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

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "step": self.step,
                                 "samples": self.samples}
        if self.stream is not None:
            state["stream"] = self.stream.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.step, self.samples = int(state["step"]), int(state.get("samples", 0))
        self.stream_state = state.get("stream")
