"""Sharded training (``distributed.sharding: fsdp``, FSDP2 over gloo): two sharded processes reach
the weights of one unsharded process on the same global batch, with the same losses step by
step, and their checkpoints resume on the other process count.

Every run of the module is trained once: the 1-process runs in this process, the 2-process
runs in ONE launch of two real gloo ranks (``tests/train_series.py``, one run after the other),
as in ``test_train_distributed.py``. Variants: MV-DHEL under AdamW and under plain SGD (no
momentum, lr 0.1: a gradient-scale error shows in the weights), each with the plain and the
cached step; SGD with a clipping norm small enough to clip every step (a per-shard norm in
place of the global one changes the update); geometric PVC (SGD plain, AdamW cached); ER with
an EMA teacher (sharded like the student); IPMC (AdamW plain, SGD cached) with its memory bank
(drawing 16 of 32 rows), view filter and critic (its critic trains on the gathered global
batch, so its random draws, and the bank's after them, are the one-process run's); MV-DHEL with
an image view missing from most samples, so that in some steps one process has images and the
other none. Text views (and that image view) only, no BatchNorm (gloo has no SyncBatchNorm),
dropout off.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import train_series
from test_train_distributed import check_same_training
from test_train_utils import load_weights, own_accelerate_state, run_ranks, tiny_config, write_recipe

from mmviews.modalities.presets import tiny_config as adapter_preset

TRAIN_SERIES = Path(__file__).resolve().parent / "train_series.py"
SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "max_grad_norm": None}
IPMC = {"name": "ipmc", "params": {"beta": 0.1, "view_filter_k": 1, "warmup_epochs": 1, "memory_bank_size": 32,
                                   "bank_negatives": 16, "critic_steps": 2}}
# name -> (objective section or None for mv_dhel, optimisation overrides)
VARIANTS: dict[str, tuple[dict[str, Any] | None, dict[str, Any]]] = {
    "mv_dhel-adamw": (None, {}),
    "mv_dhel-adamw-cached": (None, {"encode_chunk_size": 3}),
    "mv_dhel-sgd": (None, SGD),
    "mv_dhel-sgd-cached": (None, {**SGD, "encode_chunk_size": 3}),
    "mv_dhel-sgd-clipped": (None, {**SGD, "max_grad_norm": 0.05}),
    "geometric_pvc-sgd": ({"name": "geometric_pvc", "params": {"temperature": 0.2}}, SGD),
    "geometric_pvc-adamw-cached": ({"name": "geometric_pvc", "params": {"temperature": 0.2}}, {"encode_chunk_size": 3}),
    "ipmc-adamw": (IPMC, {}),
    "ipmc-sgd-cached": (IPMC, {**SGD, "encode_chunk_size": 3}),
    "er-ema-teacher-sgd": ({"name": "er", "params": {"temperature": 0.2}, "ema_teacher": True}, SGD),
    "mv_dhel-missing-image-sgd": (None, SGD),
    # learned objective parameters (outside FSDP: their gradients averaged by the trainer)
    # (AdamW: it has optimiser state to resume; torch's sharded optimiser load refuses a state
    # with no tensor, which momentum-free SGD's is)
    "siglip-learned-adamw-cached": ({"name": "siglip", "params": {"temperature": 0.2, "bias": -2.0}, "lr": 0.05},
                                    {"encode_chunk_size": 3}),
    "mv_dhel-learned-temperature-sgd": ({"name": "mv_dhel", "params": {"temperature": 0.2, "learn_temperature": True},
                                         "lr": 0.2}, SGD),
}
# Variants with an image view that is mostly missing: in some steps one process's share of the
# batch has no image while the other's has some (checked below), so the process without one
# must still run the sharded image adapter's gathers and reductions.
MISSING_IMAGE = {"mv_dhel-missing-image-sgd": 0.9}
RESUMED = "mv_dhel-adamw"  # checkpoints of this variant resume on the other process count
LEARNED = "siglip-learned-adamw-cached"  # ... and of this one (the optimiser's objective group)


def _recipe(folder: Path, name: str) -> Path:
    objective, optimisation = VARIANTS[name]
    raw = tiny_config(image=name in MISSING_IMAGE, batch_norm=False, dropout=0.0, num_samples=32, batch_size=16,
                      epochs=2)
    if name in MISSING_IMAGE:
        raw["data"]["options"]["missing_rate"] = {"image": MISSING_IMAGE[name]}
        # a tiny ViT (LayerNorm): a CNN's BatchNorm statistics would differ between one process
        # and two (each process's own rows) whatever the sharding
        raw["adapters"]["image"] = {**adapter_preset("open_clip"), "head": raw["adapters"]["text"]["head"]}
    raw["cpu"] = True
    if objective is not None:
        raw["objective"] = objective
    raw["optimisation"].update(optimisation)
    raw["output"].update(checkpoint_every=0, keep_last=5)
    raw["distributed"] = {"sharding": "fsdp"}  # one process: unsharded (nothing to shard)
    return write_recipe(folder / f"{name}.yaml", raw)


# Breaks of tests/mutations.py, each applied to one more run of the 2-process launch (after the
# intact runs; undone after its run): name -> (break, variant whose check must then fail).
BROKEN = {"no-gradient-reduction": ("fsdp_skip_gradient_reduction", "mv_dhel-sgd"),
          "clip-local-norm": ("fsdp_clip_local_norm", "mv_dhel-sgd-clipped"),
          "ipmc-critic-on-local-batch": ("ipmc_critic_on_local_batch", "ipmc-adamw")}


def _series(runs: dict[str, list[str]]) -> list[str]:
    """``tests/train_series.py``'s arguments: each run's ``slow_train.py`` arguments (``[--break
    NAME] -- TRAIN_ARGS``), one after the other."""
    argv: list[str] = []
    for run_args in runs.values():
        argv += [*run_args, ":::"]
    return argv[:-1]


def _resumable_copy(run: Path, copy: Path) -> Path:
    """``run`` copied without what followed its first checkpoint (step 2 of 4): the folder as a
    run stopped there left it. Returns the copy's checkpoint."""
    shutil.copytree(run, copy)
    checkpoints = sorted((copy / "checkpoints").glob("checkpoint-*"))
    for later in checkpoints[1:]:
        shutil.rmtree(later)
    for name in ("encoder", "eval", "results.json", "report.md"):
        target = copy / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    return checkpoints[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("sharded")
    recipes = {name: _recipe(folder, name) for name in VARIANTS}
    one = {name: ["--", str(recipes[name]), "--output", str(folder / f"one-{name}")] for name in VARIANTS}
    with own_accelerate_state():
        for run_argv in train_series.split_runs(_series(one)):
            assert train_series.run_one(run_argv) == 0, run_argv
    # A 1-process checkpoint (step 2) that the 2-process launch resumes sharded.
    from_one = _resumable_copy(folder / f"one-{RESUMED}", folder / "resumed-on-two")
    from_one_learned = _resumable_copy(folder / f"one-{LEARNED}", folder / "resumed-learned-on-two")
    two = {name: ["--", str(recipes[name]), "--output", str(folder / f"two-{name}")] for name in VARIANTS}
    two["resumed-on-two"] = ["--", "--resume", str(from_one), "--resume-ignore-rng"]
    two["resumed-learned-on-two"] = ["--", "--resume", str(from_one_learned), "--resume-ignore-rng"]
    for name, (break_name, variant) in BROKEN.items():
        two[name] = ["--break", break_name, "--", str(recipes[variant]), "--output", str(folder / f"broken-{name}")]
    ranks = run_ranks([sys.executable, str(TRAIN_SERIES), *_series(two)], folder, timeout=400)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-4000:]
    return {"folder": folder, "recipes": recipes}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_two_sharded_processes_match_one_process(trained, name):
    folder = trained["folder"]
    one, two = folder / f"one-{name}", folder / f"two-{name}"
    assert '"sharding": "fsdp"' in (two / "results.json").read_text()
    assert '"sharding": "none"' in (one / "results.json").read_text()
    assert '"num_processes": 2' in (two / "results.json").read_text()
    check_same_training(one, two, steps=4)
    learned_one = json.loads((one / "results.json").read_text())["objective_learned"]
    learned_two = json.loads((two / "results.json").read_text())["objective_learned"]
    assert learned_one.keys() == learned_two.keys() and bool(learned_one) == ("learned" in name)
    for key, value in learned_one.items():  # the learned temperature (and bias) moved alike
        assert math.isclose(learned_two[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, learned_one, learned_two)


def test_sharded_checkpoints_hold_full_tensors_and_resume_on_the_other_process_count(trained, tmp_path):
    folder = trained["folder"]
    two = folder / f"two-{RESUMED}"
    # The checkpoint of the sharded run holds the full tensors of one process's checkpoint.
    one_weights = load_weights(folder / f"one-{RESUMED}" / "encoder")
    from safetensors.torch import load_file

    for step in ("checkpoint-00000002", "checkpoint-00000004"):
        sharded = load_file(str(two / "checkpoints" / step / "model.safetensors"))
        unsharded = load_file(str(folder / f"one-{RESUMED}" / "checkpoints" / step / "model.safetensors"))
        assert sharded.keys() == unsharded.keys()
        for key in unsharded:
            assert sharded[key].shape == unsharded[key].shape, key
    assert load_weights(two / "encoder").keys() == one_weights.keys()
    # 1 process -> 2 sharded processes (resumed in the launch above) ...
    check_same_training(folder / f"one-{RESUMED}", folder / "resumed-on-two", steps=None)
    # ... and 2 sharded processes -> 1 process (here).
    checkpoint = _resumable_copy(two, tmp_path / "resumed-on-one")
    with own_accelerate_state():
        assert train_series.run_one(["--", "--resume", str(checkpoint)]) == 0
    check_same_training(folder / f"one-{RESUMED}", tmp_path / "resumed-on-one", steps=None)


def test_learned_parameters_resume_across_sharded_and_unsharded_checkpoints(trained, tmp_path):
    """siglip's learned scale and bias and their optimiser state (the objective's group, outside
    the sharded encoder) go through a sharded checkpoint both ways: 1 process -> 2 sharded
    (resumed in the launch) and 2 sharded -> 1 process (here), ending with the one-process run's
    values and weights."""
    folder = trained["folder"]
    expected = json.loads((folder / f"one-{LEARNED}" / "results.json").read_text())["objective_learned"]
    checkpoint = _resumable_copy(folder / f"two-{LEARNED}", tmp_path / "resumed-learned-on-one")
    with own_accelerate_state():
        assert train_series.run_one(["--", "--resume", str(checkpoint)]) == 0
    for run in (folder / "resumed-learned-on-two", tmp_path / "resumed-learned-on-one"):
        check_same_training(folder / f"one-{LEARNED}", run, steps=None)
        learned = json.loads((run / "results.json").read_text())["objective_learned"]
        assert learned.keys() == expected.keys() == {"temperature", "logit_scale", "bias"}
        for key, value in expected.items():
            assert math.isclose(learned[key], value, rel_tol=1e-5, abs_tol=1e-6), (run, key, learned, expected)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_sharded_equality_check_fails_on_the_break(trained, name):
    """Mutation tests (tests/README.md): gradients never reduce-scattered into the shards,
    clipping by each process's own shards' norm instead of the global norm (SGD clipped every
    step), IPMC's critic trained on each process's own slice: :func:`check_same_training`
    reports each."""
    variant = BROKEN[name][1]
    with pytest.raises(AssertionError):
        check_same_training(trained["folder"] / f"one-{variant}", trained["folder"] / f"broken-{name}", steps=4)


@pytest.mark.parametrize("name", sorted(MISSING_IMAGE))
def test_missing_views_on_one_process_only_happened(trained, name):
    """The missing-image variant's equality above means something: in some step one process's
    half of the global batch had no image while the other's had some (Accelerate splits each
    global batch of the sampler into contiguous halves)."""
    from mmviews.config import load_config
    from mmviews.train.trainer import build_run

    parts = build_run(load_config(trained["recipes"][name]), with_eval=False)
    dataset = parts.datasets["train"]
    present_per_half = []
    for epoch in range(2):
        parts.sampler.set_epoch(epoch)
        for batch in parts.sampler:
            half = len(batch) // 2
            present_per_half.append([sum(dataset[i]["modalities"]["image"] is not None for i in part)
                                     for part in (batch[:half], batch[half:])])
    assert any(min(counts) == 0 < max(counts) for counts in present_per_half), present_per_half
