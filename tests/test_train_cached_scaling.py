"""The cached-embedding step's gradient scale (``optimisation.encode_chunk_size``,
:mod:`mmviews.train.step`): gradient accumulation and the fp16 loss scaler.

AdamW cancels a constant factor on the gradient and clipping replaces the gradient's norm by the
clip's, so a scale error (a backward that skips the accumulation division, or the loss scaler)
shows under neither. Here: plain SGD (no momentum, no weight decay, constant learning rate), no
clipping, ``grad_accum_steps`` 2, so that each optimiser step moves the weights by exactly
``-lr * mean of its micro-batch gradients``, recomputed by hand on a copy of the encoder (whole
batches, no chunks, no trainer, no Accelerate) from the micro-batches the loop trained on.

The fp16 path on CPU: Accelerate makes no ``GradScaler`` on CPU (it has no fp16 autocast there,
and an Accelerator's precision is fixed once per process), so the test gives the run's
Accelerator the scaler it would make with ``mixed_precision: fp16`` on a GPU, a
``torch.amp.GradScaler`` (on CPU), before ``accelerator.prepare``: ``accelerator.backward``
scales the loss and the prepared optimiser unscales and steps through it, as on a GPU. The scale is a power of two (the
scaling is exact in float32) and does not grow during the run. Checked: the gradients the scaler
unscales are ``scale * mean gradient`` (the scale applied once, the division by the number of
micro-batches applied once) and the update is ``-lr * mean gradient`` (the scale removed once)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from mutations import apply_break
from test_train_cached import gaussian_config, one_torch_thread  # noqa: F401 (an autouse fixture)

import mmviews.train.trainer as trainer
from mmviews.config import config_from_dict

LR = 0.5
ACCUM = 2
CHUNK = 5  # K = 16 samples: chunks of 5, 5, 5 and 1
SCALE = 2.0 ** 12
# An update that is off by a factor (2 for the accumulation, 2 for two processes, 4096 for the
# scaler) is off by >= 50 % of itself (measured on the breaks below: 100 %); float32 rounding
# stays below 1e-6 of the largest update of a tensor (measured: 6e-7, chunks of 1 and 5 too).
# The tolerance sits between, far from both.
UPDATE_RTOL = 1e-3


def sgd_config(chunk: int | None, **optimisation: Any) -> dict[str, Any]:
    """64 samples, K = 16: 4 micro-batches, 2 optimiser steps of 2. An MLP per view, no dropout,
    no BatchNorm: the forward pass is a function of the weights and the batch."""
    return gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=chunk, num_samples=64,
                           optimizer="sgd", lr=LR, momentum=0.0, weight_decay=0.0, schedule="constant",
                           grad_accum_steps=ACCUM, max_grad_norm=None, **optimisation)


class RecordingScaler(torch.amp.GradScaler):
    """The CPU ``GradScaler`` of the fp16 run: counts the loss scalings and records the gradients
    (by parameter id) just before each unscale."""

    def __init__(self) -> None:
        super().__init__("cpu", init_scale=SCALE, growth_interval=1_000_000)
        self.scalings = 0
        self.before_unscale: list[dict[int, torch.Tensor]] = []

    def scale(self, outputs: Any) -> Any:
        self.scalings += 1
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.before_unscale.append({id(q): q.grad.detach().clone() for group in optimizer.param_groups
                                    for q in group["params"] if q.grad is not None})
        super().unscale_(optimizer)


class Recorded:
    """What a run trained on: the weights before each micro-batch, the micro-batches, the final
    weights, the prepared loop objects and the scaler (None without one)."""

    def __init__(self) -> None:
        self.before: list[dict[str, torch.Tensor]] = []
        self.batches: list[Any] = []
        self.after: dict[str, torch.Tensor] = {}
        self.prepared: Any = None
        self.scaler: RecordingScaler | None = None

    def encoder(self) -> torch.nn.Module:
        return self.prepared.accelerator.unwrap_model(self.prepared.model)


def train_recording(config: dict[str, Any], run: Path, set_attribute: Callable[[Any, str, Any], None], *,
                    scaler: bool = False) -> Recorded:
    """Train ``config`` in this process, recording (see :class:`Recorded`); ``set_attribute``:
    a monkeypatch's ``setattr``. ``scaler``: give the Accelerator a :class:`RecordingScaler`."""
    rec = Recorded()
    step = trainer.train_step

    def recording_step(p: Any, batch: Any, max_grad_norm: float | None) -> Any:
        rec.prepared = p
        rec.before.append({k: v.detach().clone() for k, v in p.accelerator.unwrap_model(p.model).state_dict().items()})
        rec.batches.append(copy.deepcopy(batch))
        return step(p, batch, max_grad_norm)

    set_attribute(trainer, "train_step", recording_step)
    if scaler:
        make_accelerator = trainer.make_accelerator

        def with_scaler(*args: Any, **kwargs: Any) -> Any:
            accelerator = make_accelerator(*args, **kwargs)
            assert accelerator.scaler is None  # CPU: Accelerate made none
            accelerator.scaler = rec.scaler = RecordingScaler()
            return accelerator

        set_attribute(trainer, "make_accelerator", with_scaler)
    trainer.train(config_from_dict(config), run)
    rec.after = {k: v.detach().clone() for k, v in rec.encoder().state_dict().items()}
    return rec


def mean_gradients(rec: Recorded, window: int) -> dict[str, torch.Tensor]:
    """The mean over the micro-batches of optimiser step ``window`` (0-based) of the loss's
    gradient, computed on a copy of the encoder at the weights the step started from."""
    encoder = copy.deepcopy(rec.encoder())
    encoder.load_state_dict(rec.before[window * ACCUM])
    named = {n: q for n, q in encoder.named_parameters() if q.requires_grad}
    total = {n: torch.zeros_like(q) for n, q in named.items()}
    for batch in rec.batches[window * ACCUM:(window + 1) * ACCUM]:
        z, _ = encoder(batch)
        loss = rec.prepared.objective.compute(z, None).loss
        for n, g in zip(named, torch.autograd.grad(loss, list(named.values()), allow_unused=True)):
            if g is not None:
                total[n] += g
    return {n: g / ACCUM for n, g in total.items()}


def assert_update(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``got == expected`` to UPDATE_RTOL of the largest element of ``expected`` (an update)."""
    scale = expected.abs().max().item()
    assert scale > 0, f"{what}: the expected update is zero"
    torch.testing.assert_close(got, expected, rtol=0, atol=UPDATE_RTOL * scale, msg=lambda m: f"{what}: {m}")


def check_sgd_steps(rec: Recorded) -> None:
    """The guard: every optimiser step moved each weight by ``-LR * mean micro-batch gradient``
    (computed by hand), and micro-batches inside a window did not move it."""
    windows = len(rec.batches) // ACCUM
    assert windows == 2 and len(rec.batches) == 4
    ends = rec.before[ACCUM::ACCUM] + [rec.after]
    for w in range(windows):
        start, end, grads = rec.before[w * ACCUM], ends[w], mean_gradients(rec, w)
        for n, g in grads.items():
            assert_update(end[n] - start[n], -LR * g, f"step {w + 1}, {n}")
        for i in range(w * ACCUM + 1, (w + 1) * ACCUM):
            assert all(torch.equal(rec.before[i][n], start[n]) for n in grads), f"micro-batch {i} stepped"


def check_scaler(rec: Recorded) -> None:
    """The fp16 scaler's guard: the loss was scaled once per micro-batch, and the gradients the
    scaler unscaled at each optimiser step were ``SCALE * mean micro-batch gradient``."""
    assert rec.scaler is not None
    assert rec.scaler.scalings == len(rec.batches) == 4
    assert len(rec.scaler.before_unscale) == 2, "one unscale per optimiser step"
    assert rec.scaler.get_scale() == SCALE, "the scale did not change (no overflow, no growth)"
    ids = {n: id(q) for n, q in rec.encoder().named_parameters()}
    for w, seen in enumerate(rec.scaler.before_unscale):
        for n, g in mean_gradients(rec, w).items():
            assert_update(seen[ids[n]], SCALE * g, f"step {w + 1}, {n}, gradient before unscaling")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Recorded]:
    """The plain and the cached step, without and with the fp16 scaler, trained once."""
    folder = tmp_path_factory.mktemp("cached-scaling")
    out = {}
    for name, chunk, scaler in (("plain", None, False), ("cached", CHUNK, False), ("plain-fp16", None, True),
                                ("cached-fp16", CHUNK, True)):
        config = sgd_config(chunk)
        with pytest.MonkeyPatch.context() as mp:
            out[name] = train_recording(config, folder / name, mp.setattr, scaler=scaler)
    return out


@pytest.mark.parametrize("name", ["plain", "cached", "plain-fp16", "cached-fp16"])
def test_sgd_step_is_minus_lr_times_the_mean_micro_batch_gradient(runs: dict[str, Recorded], name: str) -> None:
    rec = runs[name]
    assert rec.prepared.encode_chunk_size == (None if name.startswith("plain") else CHUNK)
    check_sgd_steps(rec)


def test_cached_step_updates_equal_the_plain_steps(runs: dict[str, Recorded]) -> None:
    plain, cached = runs["plain"], runs["cached"]
    assert [b.index.tolist() for b in plain.batches] == [b.index.tolist() for b in cached.batches]
    for n in plain.after:
        assert_update(cached.after[n] - cached.before[0][n], plain.after[n] - plain.before[0][n], n)


@pytest.mark.parametrize("step", ["plain", "cached"])
def test_fp16_scaler_is_applied_and_removed_once(runs: dict[str, Recorded], step: str) -> None:
    check_scaler(runs[f"{step}-fp16"])
    # The scaled run's updates are the unscaled run's (a power-of-two scale is exact).
    unscaled, scaled = runs[step], runs[f"{step}-fp16"]
    for n, w in unscaled.after.items():
        assert_update(scaled.after[n] - scaled.before[0][n], w - unscaled.before[0][n], n)


# ---- the guards fail on the breaks (tests/README.md) ------------------------------------------
def test_cached_sgd_check_fails_when_the_accumulation_division_is_skipped(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    apply_break("cached_skip_accumulation_division", monkeypatch.setattr)
    rec = train_recording(sgd_config(CHUNK), tmp_path / "run", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="step 1"):
        check_sgd_steps(rec)


def test_cached_scaler_check_fails_when_the_backward_bypasses_the_scaler(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    apply_break("cached_bypass_scaler", monkeypatch.setattr)
    rec = train_recording(sgd_config(CHUNK), tmp_path / "run", monkeypatch.setattr, scaler=True)
    with pytest.raises(AssertionError, match="gradient before unscaling"):
        check_scaler(rec)
    with pytest.raises(AssertionError, match="step 1"):
        check_sgd_steps(rec)
