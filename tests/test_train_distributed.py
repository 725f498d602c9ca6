"""Two processes (gloo on CPU, started as `accelerate launch --multi_gpu --num_processes 2` starts
them) train a few steps and reach the same weights as one process on the same global batch.

With AdamW a constant factor on the gradient (e.g. the loss multiplied by the number of
processes) cancels out of the update, so the comparison also runs with plain SGD (no momentum,
a large learning rate), where such a factor changes the weights;
:func:`test_two_process_check_fails_when_the_loss_is_scaled` shows the check reports it. The SGD
run has dropout 0.2 on with ``optimisation.sample_keyed_dropout`` (masks keyed by dataset index,
not drawn per process), which makes dropout independent of the split;
:func:`test_two_process_check_fails_when_dropout_is_keyed_by_row` shows the check sees masks that
depend on it.

BatchNorm heads are off: on CPU, gloo has no SyncBatchNorm, so BatchNorm statistics are per
process and the runs differ (see docs/distributed.md). Torch's own dropout
(``sample_keyed_dropout: false``, the default) draws masks per process: equal in distribution
only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import train_series
from test_train_utils import load_weights, own_accelerate_state, run_ranks, tiny_config, write_recipe

from mmviews.config import load_config
from mmviews.train import build_run

TRAIN_SERIES = Path(__file__).resolve().parent / "train_series.py"
VARIANTS = {
    "adamw": ({"optimizer": "adamw", "lr": 3e-3}, 0.0),
    # Plain SGD: the update is lr * gradient, so a gradient-scale error shows in the weights;
    # no clipping (a clipped gradient has the clip's norm whatever its scale); dropout 0.2 keyed
    # by sample.
    "sgd-keyed-dropout": ({"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "max_grad_norm": None,
                           "sample_keyed_dropout": True}, 0.2),
}


def _recipe(folder: Path, variant: str) -> Path:
    # Text views only, no BatchNorm (torch has no SyncBatchNorm on CPU), so that the two runs
    # compute the same function; K = 16 samples per step in both runs (8 per process with two
    # processes; the objective gathers the embeddings).
    optimisation, dropout = VARIANTS[variant]
    raw = tiny_config(image=False, batch_norm=False, dropout=dropout, num_samples=48, batch_size=16, epochs=2)
    raw["adapters"]["text"]["head"]["dropout"] = dropout  # BERT's hidden and attention dropout, and the head's
    raw["cpu"] = True
    raw["optimisation"].update(optimisation)
    raw["output"]["checkpoint_every"] = 0
    return write_recipe(folder / f"dist-{variant}.yaml", raw)


SGD = "sgd-keyed-dropout"
# The runs of the module, each once, in two series (tests/train_series.py): one process, then one
# 2-process launch. name -> (variant, break of tests/mutations.py or None). The breaks come after
# the intact runs, in the same order in both series (each is undone before the next run).
ONE_PROCESS_RUNS = {"adamw": ("adamw", None), SGD: (SGD, None), "keyed-by-row": (SGD, "key_dropout_by_row")}
TWO_PROCESS_RUNS = {**ONE_PROCESS_RUNS, "scaled-loss": (SGD, "scale_loss")}


def _series(folder: Path, runs: dict[str, tuple[str, str | None]], prefix: str) -> list[str]:
    """``tests/train_series.py``'s arguments: ``mmviews train RECIPE --output FOLDER/PREFIX-NAME``
    for each run, with its break."""
    argv: list[str] = []
    for name, (variant, break_name) in runs.items():
        argv += [*(["--break", break_name] if break_name else []), "--", str(folder / f"dist-{variant}.yaml"),
                 "--output", str(folder / f"{prefix}-{name}"), ":::"]
    return argv[:-1]


def _train_in_this_process(argv: list[str]) -> None:
    """``tests/train_series.py ARGV`` in the test's own process (one interpreter start and the
    imports fewer: one process needs no process of its own), under :func:`own_accelerate_state`
    (one thread, as a launched process); each run's break is undone after it."""
    with own_accelerate_state():
        for run_argv in train_series.split_runs(argv):
            assert train_series.run_one(run_argv) == 0, run_argv


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Any]:
    """{"recipe": {variant: recipe}, "one": {name: run folder}, "two": {name: run folder}}: every run
    of ``ONE_PROCESS_RUNS`` in one process (this one) and of ``TWO_PROCESS_RUNS`` on two gloo
    processes (one launch of 2 ranks, :func:`run_ranks`), trained once per module."""
    folder = tmp_path_factory.mktemp("dist")
    recipes = {variant: _recipe(folder, variant) for variant in VARIANTS}
    _train_in_this_process(_series(folder, ONE_PROCESS_RUNS, "one"))
    # The two ranks as accelerate launch would start them, without its launcher process.
    ranks = run_ranks([sys.executable, str(TRAIN_SERIES), *_series(folder, TWO_PROCESS_RUNS, "two")], folder)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-4000:]
    for name in TWO_PROCESS_RUNS:
        assert '"num_processes": 2' in (folder / f"two-{name}" / "results.json").read_text()
    # The summary from the main process only: one per run.
    assert [rank.stdout.count("run folder:") for rank in ranks] == [len(TWO_PROCESS_RUNS), 0], ranks[0].stdout
    return {"recipe": recipes, "one": {name: folder / f"one-{name}" for name in ONE_PROCESS_RUNS},
            "two": {name: folder / f"two-{name}" for name in TWO_PROCESS_RUNS}}


def check_same_training(one: Path, two: Path, steps: int | None = 6) -> None:
    """The guard of "N processes == 1": same weights and same logged losses, up to float summation
    order. ``steps``: the optimiser steps both runs logged (None: the weights only, e.g. a resumed run)."""
    a, b = load_weights(one / "encoder"), load_weights(two / "encoder")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")
    if steps is None:
        return
    # The runs trained (6 steps): the logged losses match step by step too.
    log_one = (one / "metrics.csv").read_text().splitlines()
    log_two = (two / "metrics.csv").read_text().splitlines()
    assert len(log_one) == len(log_two) == steps + 1
    for r1, r2 in zip(log_one[1:], log_two[1:]):
        l1, l2 = float(r1.split(",")[2]), float(r2.split(",")[2])
        assert abs(l1 - l2) < 1e-4 * max(1.0, abs(l1)), (r1, r2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_processes_match_one_process(trained, variant, tmp_path):
    recipe, one = trained["recipe"][variant], trained["one"][variant]
    check_same_training(one, trained["two"][variant])
    # The run trained: equal weights are not those of two encoders that did not move.
    initial = build_run(load_config(recipe), with_eval=False).encoder
    initial.save_pretrained(tmp_path / "initial")
    trained_weights, start = load_weights(one / "encoder"), load_weights(tmp_path / "initial")
    assert trained_weights.keys() == start.keys()
    moved = [k for k in trained_weights if not torch.allclose(trained_weights[k], start[k], rtol=1e-3, atol=1e-4)]
    assert len(moved) > len(trained_weights) // 2, f"only {moved} changed"


def test_two_process_check_fails_when_the_loss_is_scaled(trained):
    """Mutation test (tests/README.md): the loss multiplied by the number of processes. Under
    plain SGD :func:`check_same_training` must report it (under AdamW the factor cancels, which
    is why the SGD comparison exists). The broken run is one of the 2-process launch's series."""
    with pytest.raises(AssertionError):
        check_same_training(trained["one"][SGD], trained["two"]["scaled-loss"])


def test_two_process_check_fails_when_dropout_is_keyed_by_row(trained):
    """Mutation test (tests/README.md): dropout masks keyed by the row's position in the
    process's batch rather than by its dataset index (so they depend on the split). Both runs
    carry the break: only the split differs between them."""
    with pytest.raises(AssertionError):
        check_same_training(trained["one"]["keyed-by-row"], trained["two"]["keyed-by-row"])
