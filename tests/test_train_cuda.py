"""Training on a CUDA device: what only a GPU can check (every test here is marked ``cuda`` and
skips with the reason "no CUDA device" elsewhere; ``mmviews bench gpu`` runs them all).

- bf16 autocast: the plain and the cached-embedding step log the float32 run's losses within
  bf16's rounding (:data:`BF16_LOSS_RTOL`), and the cached step follows the plain one under bf16
  (:data:`BF16_CACHED_ATOL`);
- float32: the cached step gives the plain step's losses and weights (the CPU tests' tolerances);
- FSDP2 (``distributed.sharding: fsdp``) over NCCL: two sharded processes on two GPUs reach one
  process's weights and losses (skipped with one GPU: two processes need two devices);
- ``torch.compile`` with inductor (Triton kernels) gives eager's embeddings and weights;
- a training step makes no host synchronisation: ``mmviews bench train --sync-debug warn`` runs
  the trainer's step under ``torch.cuda.set_sync_debug_mode`` and reports none.

The tolerances were set before any run on a GPU (none was available), from bf16's 8-bit
significand (relative rounding 2^-8 per operation) and the CPU tests' measured differences; the
first run on a GPU should confirm them (docs/performance.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mmviews.train.compiled import compiled_graphs
from test_train_cached import assert_same_training, gaussian_config, train_in_process, with_chunk
from test_train_utils import REPO, env, own_accelerate_state, run_ranks, tiny_config, train_command, write_recipe

pytestmark = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)

#: bf16 against float32, each loss of a 4-step run: bf16 rounds each product's inputs to 8
#: significant bits (2^-8 = 0.4 % relative); the loss sums many such terms, whose errors mostly
#: cancel (measured on CPU: ~1e-3 absolute on losses of ~3), and 4 AdamW steps carry them on.
BF16_LOSS_RTOL = 3e-2
#: The cached step against the plain step, both under bf16: the same arithmetic on chunks of the
#: batch, so cuBLAS may pick other kernels (another summation order, then a bf16 rounding of the
#: result): an ulp of bf16 on some embeddings. On CPU the two differ by < 1e-4.
BF16_CACHED_ATOL = 3e-3


def on_cuda(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` trained on the GPU."""
    return {**config, "cpu": False}


def _bf16(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "optimisation": {**config["optimisation"], "mixed_precision": "bf16"}}


def _trained(config: dict[str, Any], run: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Weights and losses of ``config`` trained in this process (Accelerate's state its own: a
    bf16 run after a float32 one)."""
    with own_accelerate_state():
        trained = train_in_process(config, run)
    results = json.loads((run / "results.json").read_text())
    assert results["device"].startswith("cuda"), results["device"]
    assert results["mixed_precision"] == config["optimisation"].get("mixed_precision", "no")
    return trained


def test_bf16_plain_and_cached_steps_follow_float32(tmp_path: Path) -> None:
    config = on_cuda(gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=None,
                                     num_samples=64))
    _, float32 = _trained(config, tmp_path / "float32")
    plain = _trained(_bf16(config), tmp_path / "bf16-plain")
    cached = _trained(_bf16(with_chunk(config, 5)), tmp_path / "bf16-cached")
    for name, (_, logged) in (("plain", plain), ("cached", cached)):
        assert len(logged) == len(float32) >= 4
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(float32), rtol=BF16_LOSS_RTOL, atol=0,
                                   msg=lambda m, name=name: f"bf16 {name} step vs float32: {m}")
    assert_same_training(plain, cached, atol=BF16_CACHED_ATOL)


def test_cached_step_equals_the_plain_step(tmp_path: Path) -> None:
    config = on_cuda(gaussian_config({"name": "geometric_pvc", "params": {"temperature": 0.2}}, chunk=None, epochs=2,
                                     num_samples=48))
    plain = _trained(config, tmp_path / "plain")
    assert_same_training(plain, _trained(with_chunk(config, 5), tmp_path / "cached"))  # 16 = 5 + 5 + 5 + 1


def test_compiled_encoder_equals_eager_with_inductor() -> None:
    """Inductor's Triton kernels (not the CPU's C++ ones): the embeddings of each step and the
    weights after them, within 10 times the CPU tolerances (Triton's fused reductions sum in
    another order than eager CUDA kernels)."""
    from test_train_compiled import (EMBEDDING_TOLERANCE, FIRST_STEP_TOLERANCE, FIXED, WEIGHT_TOLERANCE,
                                     _check_compiled_matches_eager)

    torch._dynamo.reset()
    before = compiled_graphs()
    counts, z_diff, w_rel = _check_compiled_matches_eager(FIXED, device="cuda")
    assert counts[0] > before and counts == [counts[0]] * len(counts), counts
    assert z_diff[0] <= 10 * FIRST_STEP_TOLERANCE and max(z_diff) <= 10 * EMBEDDING_TOLERANCE, z_diff
    assert w_rel <= 10 * WEIGHT_TOLERANCE, w_rel


def test_two_sharded_processes_on_nccl_match_one_process(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"FSDP2 on NCCL needs 2 CUDA devices (one per process), found {torch.cuda.device_count()}")
    from test_train_distributed import check_same_training

    raw = tiny_config(image=False, batch_norm=False, dropout=0.0, num_samples=32, batch_size=16, epochs=2)
    raw["output"].update(checkpoint_every=0)
    raw["distributed"] = {"sharding": "fsdp"}
    recipe = write_recipe(tmp_path / "sharded.yaml", raw)
    one = subprocess.run(train_command(str(recipe), "--output", str(tmp_path / "one")), capture_output=True, text=True,
                         env=env(CUDA_VISIBLE_DEVICES="0"), cwd=REPO, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    ranks = run_ranks(train_command(str(recipe), "--output", str(tmp_path / "two")), tmp_path, timeout=300)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    results = json.loads((tmp_path / "two" / "results.json").read_text())
    assert (results["sharding"], results["num_processes"]) == ("fsdp", 2) and results["device"].startswith("cuda")
    check_same_training(tmp_path / "one", tmp_path / "two", steps=4)


def test_training_step_makes_no_host_synchronisation(tmp_path: Path) -> None:
    """The trainer's step (tiny BERT text and a CNN image view, BatchNorm heads, dropout, AdamW,
    gradient clipping) under ``torch.cuda.set_sync_debug_mode("warn")``, after two warm-up
    steps (the first step of a batch size reads it once): no synchronisation reported."""
    raw = tiny_config(num_samples=64, batch_size=16, epochs=1)
    recipe = write_recipe(tmp_path / "tiny.yaml", raw)
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "mmviews.bench.train", "--recipe", str(recipe), "--case", "quickstart",
               "--device", "cuda", "--steps", "3", "--warmup", "2", "--sync-debug", "warn", "--output", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["cases"]
    found = row["sync_debug"]
    assert found["steps"] == 3 and found["mode"] == "warn"
    assert found["synchronisations"] == {} and found["first_error"] is None, found["causes"]
