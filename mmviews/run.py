"""The run folder: its layout, its checkpoints, and loading a trained run back.

A run folder written by ``mmviews train`` holds::

    config.yaml          the resolved recipe (CONFIG_FILE)
    metrics.csv          one row per logged optimiser step (LOG_FILE)
    checkpoints/checkpoint-NNNNNNNN/   complete checkpoints (train_state.json, objective.pt,
                                       Accelerate's model/optimiser/scheduler/RNG files)
    checkpoints/.tmp-checkpoint-NNNNNNNN/   a checkpoint being written (ignored when loading)
    encoder/             MultiViewEncoder.save_pretrained, once training finished
    eval/, eval_random/, eval_epoch_N/   evaluation reports (metrics.json, summary.md, plots)
    results.json, report.md              the run summary

Both the trainer (:mod:`mmviews.train`) and ``mmviews eval`` use this module, so evaluation
never depends on the training code.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mmviews.config import ConfigError, TrainConfig, load_config
from mmviews.data.loaders import build_eval_loaders, eval_view_config
from mmviews.modalities.multiview import MultiViewEncoder

CONFIG_FILE = "config.yaml"
LOG_FILE = "metrics.csv"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
TRAIN_STATE_FILE = "train_state.json"
OBJECTIVE_FILE = "objective.pt"
ENCODER_DIR = "encoder"
EVAL_METRICS_FILE = "metrics.json"  # inside each evaluation folder
RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    folder = Path(run_dir) / CHECKPOINTS_DIR
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete checkpoint folder (it has its ``train_state.json``)."""
    return (Path(path) / TRAIN_STATE_FILE).is_file()


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a checkpoint folder, else the latest checkpoint of the run
    folder ``path``."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {path} "
                                f"(expected {path}/{CHECKPOINTS_DIR}/{CHECKPOINT_PREFIX}N)")
    return found[-1]


def run_dir_of(checkpoint: Path) -> Path:
    """The run folder of a checkpoint folder (``RUN/checkpoints/checkpoint-N``)."""
    return checkpoint.parent.parent


def build_encoder(config: TrainConfig, source: str = "recipe") -> nn.Module:
    """The recipe's :class:`MultiViewEncoder` (``adapters`` and ``encoder`` sections), freshly
    initialised; an invalid section is a :class:`ConfigError` naming ``source``."""
    try:
        return MultiViewEncoder.from_config(config.encoder_config())
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{source}: keys 'adapters'/'encoder': {error}") from error


def eval_loaders(config: TrainConfig, train_dataset: Dataset | None = None) -> dict[str, DataLoader | None]:
    """The recipe's evaluation loaders (see :func:`mmviews.data.loaders.build_eval_loaders`):
    ``evaluation.views``, else one natural view per modality of the training ``views``."""
    views = eval_view_config(config.views, config.evaluation.views)
    return build_eval_loaders(config.data, views, config.seed, train_dataset)


def load_run(path: str | os.PathLike[str]) -> tuple[nn.Module, TrainConfig, dict[str, DataLoader | None]]:
    """Load a trained run for evaluation: ``(encoder, config, loaders)``.

    ``path``: a run folder (uses its ``encoder/`` if training finished, else its latest
    checkpoint) or a checkpoint folder. ``encoder(batch) -> (z [K, M, d], mask [K, M])`` is on
    CPU in eval mode; ``config`` is the run's resolved :class:`TrainConfig`; ``loaders`` maps
    ``"train"``, ``"val"``, ``"test"`` to unshuffled, un-augmented loaders of the recipe's
    splits (None for a split the recipe lacks), with the evaluation views.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run or checkpoint at {path}")
    checkpoint_given = is_checkpoint(path)
    run_dir = run_dir_of(path) if checkpoint_given else path
    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not an mmviews run: missing {config_path}")
    config = load_config(config_path)
    if not checkpoint_given and (run_dir / ENCODER_DIR).is_dir():
        encoder = MultiViewEncoder.from_pretrained(run_dir / ENCODER_DIR)
    else:
        checkpoint = find_checkpoint(path)
        encoder = build_encoder(config, str(config_path))
        weights = checkpoint / "model.safetensors"
        if weights.is_file():
            state = load_file(str(weights))
        else:  # Accelerate saves pytorch_model.bin when safetensors is off
            state = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
        encoder.load_state_dict(state, strict=True)
    encoder.eval()
    return encoder, config, eval_loaders(config)
