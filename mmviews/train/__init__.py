"""Training with HuggingFace Accelerate: run assembly, the loop, checkpoints, logging.

- :func:`train`: train or resume a run folder (the loop, :mod:`mmviews.train.trainer`), with
  an optional :class:`TrainCallback`; SIGINT/SIGTERM stop it after the current step with a
  checkpoint and raise :class:`TrainingInterrupted` (:mod:`mmviews.train.interrupt`).
- :func:`build_run`: build and check everything a recipe describes (:mod:`mmviews.train.build`).
- :mod:`mmviews.train.setup`: a built run's accelerator and prepared objects, which the loop and
  ``mmviews bench`` share (:func:`~mmviews.train.setup.make_accelerator`, :func:`~mmviews.train.setup.prepare_run`).
- :mod:`mmviews.train.checkpoint`, :mod:`mmviews.train.step_log`, :mod:`mmviews.train.trackers`, :mod:`mmviews.train.optim`,
  :mod:`mmviews.train.teacher`: the loop's parts; :class:`TrainState`, where the loop is, is
  :mod:`mmviews.train.state`.
- :func:`estimate_memory`: the estimated peak memory per device of a built run, and the
  ``encode_chunk_size`` that fits a budget (:mod:`mmviews.train.memory`, ``mmviews train --check``).
- :func:`train_step`: one micro-batch's step; :func:`cached_train_step`: the same as a
  cached-embedding step (GradCache), used by the loop when ``optimisation.encode_chunk_size`` is
  set (both :mod:`mmviews.train.step`).

Recipes are :mod:`mmviews.config` (:class:`TrainConfig`, :func:`load_config`); the run folder
and :func:`load_run` are :mod:`mmviews.run`; the command is ``mmviews train``
(:mod:`mmviews.cli.train`). Those names are re-exported here for convenience.
"""

from mmviews.config import ConfigError, TrainConfig, load_config, resolve_recipe, save_config
from mmviews.run import find_checkpoint, list_checkpoints, load_run
from mmviews.train.build import RunParts, build_encoder, build_objective, build_run
from mmviews.train.callbacks import TrainCallback
from mmviews.train.interrupt import TrainingInterrupted
from mmviews.train.memory import MemoryEstimate, estimate_memory
from mmviews.train.optim import LARS, build_optimizer, build_scheduler
from mmviews.train.state import TrainState
from mmviews.train.step import cached_train_step, train_step
from mmviews.train.trainer import train

__all__ = [
    "ConfigError",
    "LARS",
    "MemoryEstimate",
    "RunParts",
    "TrainCallback",
    "TrainConfig",
    "TrainState",
    "TrainingInterrupted",
    "build_encoder",
    "build_objective",
    "build_optimizer",
    "build_run",
    "build_scheduler",
    "cached_train_step",
    "estimate_memory",
    "find_checkpoint",
    "list_checkpoints",
    "load_config",
    "load_run",
    "resolve_recipe",
    "save_config",
    "train",
    "train_step",
]
