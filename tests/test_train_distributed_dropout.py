"""With sample-keyed dropout, two processes (gloo on CPU) reach the weights of one process with
dropout ON: each row's mask depends on its sample, not on which process encodes it. Plain SGD
without momentum, so that any difference in the gradients shows in the weights."""

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


def test_two_processes_match_one_process_with_keyed_dropout(tmp_path):
    # No BatchNorm (per process on CPU); dropout 0.2 on BERT's hidden states and attention and
    # in the heads; K = 16 (8 per process); 2 steps.
    raw = tiny_config(image=False, batch_norm=False, dropout=0.2, num_samples=32, batch_size=16, epochs=1)
    raw["adapters"]["text"]["head"]["dropout"] = 0.2
    raw["cpu"] = True
    raw["optimisation"].update(optimizer="sgd", momentum=0.0, lr=0.5, sample_keyed_dropout=True)
    raw["output"]["checkpoint_every"] = 0
    raw["evaluation"]["random_baseline"] = False
    recipe = write_recipe(tmp_path / "keyed.yaml", raw)

    one = run_train(str(recipe), "--output", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port()),
                "-m", "mmviews.cli", "train", str(recipe), "--output", str(tmp_path / "two")]
    two = subprocess.run(launcher, capture_output=True, text=True, timeout=240, env=env(), cwd=REPO)
    assert two.returncode == 0, two.stderr[-4000:]
    assert '"num_processes": 2' in (tmp_path / "two" / "results.json").read_text()

    a, b = load_weights(tmp_path / "one" / "encoder"), load_weights(tmp_path / "two" / "encoder")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
