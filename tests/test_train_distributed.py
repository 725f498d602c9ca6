"""Two processes (gloo on CPU, `accelerate launch --multi_gpu --num_processes 2`) train a few
steps and reach the same weights as one process on the same global batch.

With AdamW a constant factor on the gradient (e.g. the loss multiplied by the number of
processes) cancels out of the update, so the comparison also runs with plain SGD (no momentum,
a large learning rate), where such a factor changes the weights;
:func:`test_two_process_check_fails_when_the_loss_is_scaled` shows the check reports it. The SGD
run has dropout 0.2 on with ``optimisation.sample_keyed_dropout`` (masks keyed by dataset index,
not drawn per process), which makes dropout independent of the split;
:func:`test_two_process_check_fails_when_dropout_is_keyed_by_row` shows the check sees masks that
depend on it.

BatchNorm heads are off: on CPU, gloo has no SyncBatchNorm, so BatchNorm statistics are per
process and the runs differ (see the README, "Several GPUs or nodes"). Torch's own dropout
(``sample_keyed_dropout: false``, the default) draws masks per process: equal in distribution
only."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_utils import REPO, env, load_weights, run_in_group, run_train, tiny_config, write_recipe

from mmviews.config import load_config
from mmviews.train import build_run

SLOW_TRAIN = Path(__file__).resolve().parent / "slow_train.py"
VARIANTS = {
    "adamw": ({"optimizer": "adamw", "lr": 3e-3}, 0.0),
    # Plain SGD: the update is lr * gradient, so a gradient-scale error shows in the weights;
    # no clipping (a clipped gradient has the clip's norm whatever its scale); dropout 0.2 keyed
    # by sample.
    "sgd-keyed-dropout": ({"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "max_grad_norm": None,
                           "sample_keyed_dropout": True}, 0.2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """``one_process(variant)`` -> (recipe, run folder of one process), trained once per module."""
    runs: dict[str, tuple[Path, Path]] = {}

    def get(variant: str) -> tuple[Path, Path]:
        if variant not in runs:
            folder = tmp_path_factory.mktemp(f"one-{variant}")
            recipe = _recipe(folder, variant)
            one = run_train(str(recipe), "--output", str(folder / "one"))
            assert one.returncode == 0, one.stderr[-3000:]
            runs[variant] = recipe, folder / "one"
        return runs[variant]

    return get


def train_two_processes(recipe: Path, run: Path, *slow_train_options: str) -> None:
    """``mmviews train RECIPE --output RUN`` on two gloo processes (through ``tests/slow_train.py``
    when it is given options, e.g. ``--break scale_loss``)."""
    program = [str(SLOW_TRAIN), *slow_train_options] if slow_train_options else ["-m", "mmviews.cli", "train"]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port()), *program, str(recipe), "--output", str(run)]
    two = run_in_group(launcher, timeout=240)  # a failed launch leaves no rank behind
    assert two.returncode == 0, two.stderr[-4000:]
    assert '"num_processes": 2' in (run / "results.json").read_text()
    assert two.stdout.count("run folder:") == 1, two.stdout  # the summary from the main process only


def check_same_training(one: Path, two: Path) -> None:
    """The guard of "N processes == 1": same weights and same logged losses, up to float summation order."""
    a, b = load_weights(one / "encoder"), load_weights(two / "encoder")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")
    # The runs trained (6 steps): the logged losses match step by step too.
    log_one = (one / "metrics.csv").read_text().splitlines()
    log_two = (two / "metrics.csv").read_text().splitlines()
    assert len(log_one) == len(log_two) == 7
    for r1, r2 in zip(log_one[1:], log_two[1:]):
        l1, l2 = float(r1.split(",")[2]), float(r2.split(",")[2])
        assert abs(l1 - l2) < 1e-4 * max(1.0, abs(l1)), (r1, r2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_processes_match_one_process(one_process, variant, tmp_path):
    recipe, one = one_process(variant)
    train_two_processes(recipe, tmp_path / "two")
    check_same_training(one, tmp_path / "two")
    # The run trained: equal weights are not those of two encoders that did not move.
    initial = build_run(load_config(recipe), with_eval=False).encoder
    initial.save_pretrained(tmp_path / "initial")
    trained, start = load_weights(one / "encoder"), load_weights(tmp_path / "initial")
    assert trained.keys() == start.keys()
    moved = [k for k in trained if not torch.allclose(trained[k], start[k], rtol=1e-3, atol=1e-4)]
    assert len(moved) > len(trained) // 2, f"only {moved} changed"


def test_two_process_check_fails_when_the_loss_is_scaled(one_process, tmp_path):
    """Mutation test (tests/README.md): the loss multiplied by the number of processes. Under
    plain SGD :func:`check_same_training` must report it (under AdamW the factor cancels, which
    is why the SGD comparison exists)."""
    recipe, one = one_process("sgd-keyed-dropout")
    train_two_processes(recipe, tmp_path / "two", "--break", "scale_loss")
    with pytest.raises(AssertionError):
        check_same_training(one, tmp_path / "two")


def test_two_process_check_fails_when_dropout_is_keyed_by_row(one_process, tmp_path):
    """Mutation test (tests/README.md): dropout masks keyed by the row's position in the
    process's batch rather than by its dataset index (so they depend on the split). Both runs
    carry the break: only the split differs between them."""
    recipe, _ = one_process("sgd-keyed-dropout")
    one = subprocess.run([sys.executable, str(SLOW_TRAIN), "--break", "key_dropout_by_row", "--", str(recipe),
                          "--output", str(tmp_path / "one")], capture_output=True, text=True, timeout=240, env=env(),
                         cwd=REPO)
    assert one.returncode == 0, one.stderr[-3000:]
    train_two_processes(recipe, tmp_path / "two", "--break", "key_dropout_by_row")
    with pytest.raises(AssertionError):
        check_same_training(tmp_path / "one", tmp_path / "two")
