"""Two processes (gloo on CPU, `accelerate launch --multi_gpu --num_processes 2`) train a few
steps and reach the same weights as one process on the same global batch."""

from __future__ import annotations

import socket
import subprocess
import sys

import torch
from test_train_utils import REPO, env, load_weights, run_train, tiny_config, write_recipe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path):
    # Text views only, no BatchNorm (torch has no SyncBatchNorm on CPU) and no dropout, so
    # that the two runs compute the same function; K = 16 samples per step in both runs
    # (8 per process with two processes; the objective gathers the embeddings).
    raw = tiny_config(image=False, batch_norm=False, dropout=0.0, num_samples=48, batch_size=16, epochs=2)
    raw["cpu"] = True
    raw["output"]["checkpoint_every"] = 0
    recipe = write_recipe(tmp_path / "dist.yaml", raw)

    one = run_train(str(recipe), "--output", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]

    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port()),
                "-m", "mmviews.cli", "train", str(recipe), "--output", str(tmp_path / "two")]
    two = subprocess.run(launcher, capture_output=True, text=True, timeout=240, env=env(), cwd=REPO)
    assert two.returncode == 0, two.stderr[-4000:]
    assert two.stdout.count("run folder:") == 1, two.stdout  # the summary from the main process only

    results = (tmp_path / "two" / "results.json").read_text()
    assert '"num_processes": 2' in results
    a, b = load_weights(tmp_path / "one" / "encoder"), load_weights(tmp_path / "two" / "encoder")
    assert a.keys() == b.keys()
    for k in a:
        # Same global batch, same gradients up to float summation order.
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")
    # The runs trained (6 steps): the logged losses match step by step too.
    log_one = (tmp_path / "one" / "metrics.csv").read_text().splitlines()
    log_two = (tmp_path / "two" / "metrics.csv").read_text().splitlines()
    assert len(log_one) == len(log_two) == 7
    for r1, r2 in zip(log_one[1:], log_two[1:]):
        l1, l2 = float(r1.split(",")[2]), float(r2.split(",")[2])
        assert abs(l1 - l2) < 1e-4 * max(1.0, abs(l1)), (r1, r2)
