"""The recipe's probes run from the training loop (random baseline, every N epochs, at the end)."""

from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from mmviews.eval.evaluate import evaluate_encoder
from mmviews.run import record_run_outputs
from mmviews.train.build import RunParts


@contextmanager
def rng_preserved() -> Iterator[None]:
    """Run evaluation without moving the training RNG streams (torch, numpy, random), so
    that where evaluations happen does not change the trained weights."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def run_evaluation(encoder: nn.Module, parts: RunParts, out_dir: Path, accelerator: Any | None,
                   log_csv: Path | None = None, meta: dict[str, Any] | None = None) -> dict[str, float]:
    """The recipe's probes (``evaluation.tasks``) on ``encoder``; report written to ``out_dir``
    (a folder of the run folder, listed in the run's manifest before anything is written to it)."""
    if accelerator is None or accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        record_run_outputs(out_dir.parent)
    loaders = parts.eval_loaders
    with rng_preserved():
        return evaluate_encoder(encoder, loaders.get("train"), loaders.get("val"), loaders.get("test"),
                                parts.config.eval_tasks, out_dir, accelerator, log_csv=log_csv,
                                meta=meta, seed=parts.config.seed, fuse=parts.config.evaluation.fuse,
                                progress=parts.config.output.progress_bar, plots=parts.config.evaluation.plots)
