"""Gradient accumulation (``optimisation.grad_accum_steps`` = n) in the real training loop: an
optimiser step follows the average of its n micro-batch gradients, computed here by hand from
the micro-batches the loop trained on; the optimiser and the schedule step once per window.
Sample-keyed dropout is keyed by the micro-batch, not the optimiser step: under accumulation the
micro-batches of one window draw masks of their own. (Resuming in the middle of a window: tests/test_train_resume.py.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_train_utils import tiny_config, write_recipe

import mmviews.train.trainer as trainer
from mmviews.config import load_config
from mmviews.train import TrainCallback

LR = 0.5
ACCUM = 2


class CountSteps(TrainCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, state) -> None:
        self.steps.append(state.step)


def _config(tmp_path):
    # 64 samples, K = 16: 4 micro-batches, 2 windows of 2. No dropout, no BatchNorm, text views
    # only: the forward pass is a function of the weights and the batch, so it can be redone here.
    # Plain SGD without clipping: weights after a step = weights before - lr * gradient.
    raw = tiny_config(image=False, batch_norm=False, dropout=0.0, num_samples=64, batch_size=16, epochs=1)
    raw["cpu"] = True
    raw["optimisation"] = {"optimizer": "sgd", "lr": LR, "momentum": 0.0, "epochs": 1, "warmup_steps": 0,
                           "schedule": "cosine", "grad_accum_steps": ACCUM, "max_grad_norm": None}
    raw["evaluation"] = {"tasks": [], "random_baseline": False, "at_end": False}
    raw["output"].update(checkpoint_every=0, trackers=[])
    return load_config(write_recipe(tmp_path / "accum.yaml", raw))


def train_recording(tmp_path, monkeypatch):
    """Train the recipe in this process; returns (weights before each micro-batch, the
    micro-batches, the weights at the end, optimiser steps seen by the callback, the prepared
    loop objects)."""
    before, batches, prepared = [], [], []
    step = trainer.train_step

    def recording_step(p, batch, max_grad_norm):
        prepared[:] = [p]
        before.append({k: v.detach().clone() for k, v in p.accelerator.unwrap_model(p.model).state_dict().items()})
        batches.append(copy.deepcopy(batch))
        return step(p, batch, max_grad_norm)

    monkeypatch.setattr(trainer, "train_step", recording_step)
    callback = CountSteps()
    trainer.train(_config(tmp_path), tmp_path / "run", callback=callback)
    p = prepared[0]
    after = {k: v.detach().clone() for k, v in p.accelerator.unwrap_model(p.model).state_dict().items()}
    return before, batches, after, callback.steps, p


def check_steps_average_micro_batch_gradients(before, batches, after, p) -> None:
    """The guard: for each window of ACCUM micro-batches, the weights after its step equal the
    weights before it minus lr(step) times the AVERAGE of the micro-batch gradients, each
    gradient computed here on a fresh copy of the encoder; lr(step) is the cosine schedule at
    the optimiser step (not at the micro-batch) index."""
    encoder = copy.deepcopy(p.accelerator.unwrap_model(p.model))
    names = [n for n, q in encoder.named_parameters() if q.requires_grad]
    windows = len(batches) // ACCUM
    ends = before[ACCUM::ACCUM] + [after]
    for w in range(windows):
        start = before[w * ACCUM]
        encoder.load_state_dict(start)
        params = [dict(encoder.named_parameters())[n] for n in names]
        grads = []
        for batch in batches[w * ACCUM:(w + 1) * ACCUM]:
            z, _ = encoder(batch)
            loss = p.objective.compute(z, None).loss
            grads.append([torch.zeros_like(q) if g is None else g  # unused weights (e.g. BERT's pooler) stay put
                          for q, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))])
        lr = LR * 0.5 * (1 + math.cos(math.pi * w / windows))  # cosine, no warm-up, `windows` steps
        for n, *g in zip(names, *grads):
            expected = start[n] - lr * torch.stack(g).mean(0)
            torch.testing.assert_close(ends[w][n], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n, w=w: f"step {w + 1}, {n}: {m}")
        # Micro-batches inside a window do not move the weights.
        for i in range(w * ACCUM + 1, (w + 1) * ACCUM):
            assert all(torch.equal(before[i][n], start[n]) for n in names), f"micro-batch {i} stepped"


def test_accumulated_step_is_the_average_of_micro_batch_gradients(tmp_path, monkeypatch):
    before, batches, after, steps, p = train_recording(tmp_path, monkeypatch)
    assert len(batches) == 4 and steps == [1, 2]  # 4 micro-batches, one optimiser step per window of 2
    assert p.scheduler.scheduler.last_epoch == 2  # the schedule advanced once per optimiser step
    assert p.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # cosine ends at 0 after 2 steps
    check_steps_average_micro_batch_gradients(before, batches, after, p)
    assert any(not torch.equal(after[n], before[0][n]) for n in after)  # it trained


def test_accumulation_check_fails_when_gradients_are_summed(tmp_path, monkeypatch):
    """Mutation test (tests/README.md): micro-batch gradients summed instead of averaged."""
    from mutations import apply_break

    apply_break("sum_accumulated_gradients", monkeypatch.setattr)
    before, batches, after, steps, p = train_recording(tmp_path, monkeypatch)
    assert steps == [1, 2]
    with pytest.raises(AssertionError, match="step 1"):
        check_steps_average_micro_batch_gradients(before, batches, after, p)


# --------------------------------------------------------------------------- sample-keyed dropout under accumulation


def keyed_dropout_keys(tmp_path, monkeypatch) -> tuple[list[int | None], int]:
    """Train a recipe with sample-keyed dropout and ``grad_accum_steps`` 2 in this process, 2
    epochs of 4 micro-batches; returns the dropout key each encoder forward ran under (what the
    keyed layers read, :func:`~mmviews.modalities.dropout.keys.active_step_key`) and the run's seed."""
    from mmviews.modalities.dropout.keys import active_step_key
    from mmviews.modalities.multiview import MultiViewEncoder

    raw = tiny_config(image=False, batch_norm=False, dropout=0.2, num_samples=64, batch_size=16, epochs=2)
    raw["cpu"], raw["seed"] = True, 7
    raw["optimisation"] = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "epochs": 2, "warmup_steps": 0,
                           "grad_accum_steps": ACCUM, "max_grad_norm": None, "sample_keyed_dropout": True}
    raw["evaluation"] = {"tasks": [], "random_baseline": False, "at_end": False}
    raw["output"].update(checkpoint_every=0, trackers=[])
    keys: list[int | None] = []
    forward = MultiViewEncoder.forward

    def recording_forward(self, batch):  # a spy: the forward itself is unchanged
        if self.training:
            keys.append(active_step_key())
        return forward(self, batch)

    monkeypatch.setattr(MultiViewEncoder, "forward", recording_forward)
    callback = CountSteps()
    trainer.train(load_config(write_recipe(tmp_path / "keyed.yaml", raw)), tmp_path / "run", callback=callback)
    assert callback.steps == [1, 2, 3, 4]  # 8 micro-batches, one optimiser step per window of 2
    return keys, 7


def check_dropout_keyed_by_micro_batch(keys: list[int | None], seed: int) -> None:
    """The guard: micro-batch m of the run (m = epoch * batches_per_epoch + batch_in_epoch) runs
    under the key of (seed, m): the two micro-batches of one accumulation window, and the same
    batch position in the next epoch, get keys of their own."""
    from mmviews.modalities.dropout.keys import step_key

    assert keys == [step_key(seed, m) for m in range(8)], keys


def test_keyed_dropout_is_keyed_by_the_micro_batch_under_accumulation(tmp_path, monkeypatch):
    keys, seed = keyed_dropout_keys(tmp_path, monkeypatch)
    check_dropout_keyed_by_micro_batch(keys, seed)


def test_micro_batch_key_check_fails_when_dropout_is_keyed_by_the_optimiser_step(tmp_path, monkeypatch):
    """Mutation test (tests/README.md): the keys taken from the optimiser step (the two
    micro-batches of a window share one key)."""
    from mutations import apply_break

    apply_break("key_dropout_by_optimiser_step", monkeypatch.setattr)
    keys, seed = keyed_dropout_keys(tmp_path, monkeypatch)
    assert keys[0] == keys[1]  # the break did what it says
    with pytest.raises(AssertionError):
        check_dropout_keyed_by_micro_batch(keys, seed)
