"""Training with HuggingFace Accelerate: typed YAML recipes, the loop, checkpoints, runs.

- :func:`load_config` / :class:`TrainConfig`: recipes (``mmviews.train.config``).
- :func:`train`: train or resume a run folder (``mmviews.train.trainer``).
- :func:`load_run`: ``load_run(path) -> (encoder, config, loaders)`` for evaluation of a
  run folder or checkpoint (used by ``mmviews eval``).
- ``mmviews train RECIPE``: :mod:`mmviews.train.cli`.
"""

from mmviews.train.config import ConfigError, TrainConfig, load_config, resolve_recipe, save_config
from mmviews.train.optim import LARS, build_optimizer, build_scheduler
from mmviews.train.trainer import build_run, find_checkpoint, list_checkpoints, load_run, train

__all__ = [
    "ConfigError",
    "LARS",
    "TrainConfig",
    "build_optimizer",
    "build_run",
    "build_scheduler",
    "find_checkpoint",
    "list_checkpoints",
    "load_config",
    "load_run",
    "resolve_recipe",
    "save_config",
    "train",
]
