"""The loop's one extension point: a :class:`TrainCallback` given to ``train(..., callback=)``.

The loop calls every method at a fixed point; the base class does nothing, so a callback
overrides only the events it needs. Tests use it to slow a run down so that it can be killed
at a chosen moment (``tests/slow_train.py``); it is also the place for user-side monitoring.
"""

from __future__ import annotations

from pathlib import Path

from mmviews.train.state import TrainState


class TrainCallback:
    """No-op hooks called by :func:`mmviews.train.train` (on every process unless noted)."""

    def on_step_end(self, state: TrainState) -> None:
        """After optimiser step ``state.step`` (and its logging), before any checkpoint of it."""

    def on_checkpoint_written(self, state: TrainState, folder: Path) -> None:
        """Main process only: every file of the checkpoint of ``state.step`` is in its
        temporary ``folder``, which is not yet renamed to ``checkpoint-N``. A kill here
        must leave the previous complete checkpoint usable."""
