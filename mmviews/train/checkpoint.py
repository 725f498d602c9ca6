"""Checkpoints you can kill: the loop position, and writing and loading checkpoints.

A checkpoint is ``accelerator.save_state`` (model, optimiser, scheduler, scaler, RNG states of
every process, the EMA teacher and :class:`TrainState`, which are registered for
checkpointing) plus ``objective.pt`` (the objective's ``state_dict``: memory banks, critics)
and ``train_state.json``. Everything is written into ``checkpoints/.tmp-checkpoint-N`` and the
folder is renamed to ``checkpoint-N`` only when complete, so a kill mid-write leaves the
previous checkpoint intact; the last ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mmviews.config import TrainConfig, save_config
from mmviews.run import (
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    ENCODER_DIR,
    OBJECTIVE_FILE,
    TMP_PREFIX,
    TRAIN_STATE_FILE,
    list_checkpoints,
)

if TYPE_CHECKING:
    from mmviews.train.callbacks import TrainCallback


@dataclass
class TrainState:
    """Where the loop is; saved in every checkpoint. ``batch_in_epoch`` counts the
    micro-batches of ``epoch`` already trained on; ``step`` the optimiser steps; ``samples``
    the samples seen (global, over all processes)."""

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    samples: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "step": self.step, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.step, self.samples = int(state["step"]), int(state.get("samples", 0))


def prepare_run_dir(run_dir: Path, config: TrainConfig, fresh: bool) -> None:
    """Main process, before training: the run folder with the resolved ``config.yaml``. A
    ``fresh`` run (not resumed, e.g. ``--overwrite``) first drops stale checkpoints and
    encoder; temporary checkpoint folders left by a kill are always removed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        for stale in (CHECKPOINTS_DIR, ENCODER_DIR):
            shutil.rmtree(run_dir / stale, ignore_errors=True)
    save_config(config, run_dir / CONFIG_FILE)
    folder = run_dir / CHECKPOINTS_DIR
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(accelerator: Any, run_dir: Path, state: TrainState, keep_last: int, objective: nn.Module,
                    callback: TrainCallback) -> Path:
    """``save_state`` into a temporary folder, then rename: a kill mid-write never replaces
    a complete checkpoint. Every process calls this (each saves its RNG state)."""
    folder = run_dir / CHECKPOINTS_DIR
    final = folder / f"{CHECKPOINT_PREFIX}{state.step:08d}"
    tmp = folder / f"{TMP_PREFIX}{state.step:08d}"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(objective.state_dict(), tmp / OBJECTIVE_FILE)
        (tmp / TRAIN_STATE_FILE).write_text(json.dumps(state.state_dict()))
        callback.on_checkpoint_written(state, tmp)
        if final.exists():  # same step saved twice (e.g. resumed and re-saved): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(checkpoint: Path, accelerator: Any, state: TrainState, objective: nn.Module) -> None:
    """Restore a checkpoint into the prepared objects (every process)."""
    # The objective first: loading may build lazily created parts (IPMC's critic), which
    # draws random numbers; load_state then restores the RNG states.
    objective.load_state_dict(torch.load(checkpoint / OBJECTIVE_FILE, map_location=accelerator.device,
                                         weights_only=True))
    accelerator.load_state(str(checkpoint))
    state.load_state_dict(json.loads((checkpoint / TRAIN_STATE_FILE).read_text()))
