"""The optimiser's end of a training step (:mod:`mmviews.train.step`) with an objective that
learns its parameters (a learned temperature, siglip's scale and bias).

What a user relies on: over N processes the learned parameters' gradients are the mean of the
processes' gradients (the one-process gradient of the whole batch), not the sum nor each
process's own; the learned inverse temperature never stays above open_clip's bound of 100
after a real optimiser step; inside an accumulation window nothing is averaged, clipped,
stepped or clamped; ``max_grad_norm`` unset leaves every gradient as it is, set it scales all of
them (encoder and learned parameters) by one coefficient; the gradients are cleared after the
step. Real objectives, a real Accelerator and real gloo processes (``run_ranks``).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_utils import own_accelerate_state, run_ranks, tiny_config, write_recipe

from mmviews.objectives import get_objective
from mmviews.objectives._base import MAX_LOGIT_SCALE
from mmviews.train.step import average_objective_gradients, clip_gradients, optimizer_step

# Each rank: a siglip objective (learned scale and bias) whose gradients are rank-dependent, a
# mv_dhel one whose learned temperature has no gradient (left None), and a fixed-temperature
# one (no learned parameter: nothing to reduce, and no collective another rank would miss).
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from mmviews.objectives import get_objective
    from mmviews.train.step import average_objective_gradients

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    siglip = get_objective("siglip", temperature=0.1, bias=-10.0)
    scale, bias = siglip.trained_parameters()
    scale.grad = torch.full_like(scale, 1.0 + rank)           # 1, 2  -> mean 1.5
    bias.grad = torch.full_like(bias, 10.0 * (rank + 1) ** 2)  # 10, 40 -> mean 25
    untouched = get_objective("mv_dhel", temperature=0.2, learn_temperature=True)
    fixed = get_objective("mv_dhel", temperature=0.2)
    for objective in (siglip, untouched, fixed):
        average_objective_gradients(objective)
    print(json.dumps({"rank": rank, "world": dist.get_world_size(), "scale": scale.grad.item(),
                      "bias": bias.grad.item(), "scale_shape": list(scale.grad.shape),
                      "untouched": untouched.trained_parameters()[0].grad is None}))
    dist.destroy_process_group()
""")


def test_learned_parameters_gradients_are_the_mean_over_two_processes(tmp_path: Path) -> None:
    """Two gloo processes: each holds its own gradient of siglip's scale and bias; after the
    reduction both hold the mean (1.5 and 25: neither the sum 3 and 50, nor their own), a
    parameter without a gradient stays without one, and an objective that learns nothing
    takes no part. One process: the gradients are left as they are."""
    siglip = get_objective("siglip", temperature=0.1, bias=-10.0)
    scale, bias = siglip.trained_parameters()
    scale.grad, bias.grad = torch.full_like(scale, 2.0), torch.full_like(bias, -3.0)
    average_objective_gradients(siglip)
    assert (scale.grad.item(), bias.grad.item()) == (2.0, -3.0)

    results = run_ranks([sys.executable, "-c", RANK_SCRIPT], tmp_path, num_processes=2, timeout=180)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    rows = sorted((json.loads(r.stdout.strip().splitlines()[-1]) for r in results), key=lambda row: row["rank"])
    for rank, row in enumerate(rows):
        assert row["rank"] == rank and row["world"] == 2
        assert row["scale"] == pytest.approx(1.5, abs=1e-12)
        assert row["bias"] == pytest.approx(25.0, abs=1e-12)
        assert row["scale_shape"] == []  # the parameter's own shape, a 0-dim tensor
        assert row["untouched"]


def _prepared(folder: Path, objective: dict[str, Any], **optimisation: Any):
    """A prepared tiny run (text views, no BatchNorm, no dropout, plain SGD) on CPU."""
    from mmviews.config import load_config
    from mmviews.train.build import build_run
    from mmviews.train.setup import make_accelerator, prepare_run

    raw = tiny_config(image=False, batch_norm=False, dropout=0.0, num_samples=32, batch_size=16, epochs=1)
    raw["cpu"] = True
    raw["objective"] = objective
    raw["optimisation"].update({"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "warmup_steps": 0, "warmup_epochs": 0,
                                "schedule": "constant", **optimisation})
    config = load_config(write_recipe(folder / "recipe.yaml", raw))
    parts = build_run(config, with_eval=False)
    return config, prepare_run(make_accelerator(config, folder / "run"), parts)


def _set_gradients(p, objective_grad: float) -> list[torch.Tensor]:
    """Small random gradients on the encoder, ``objective_grad`` on each learned parameter;
    returns the trained parameters (encoder first)."""
    trained = [q for q in p.model.parameters() if q.requires_grad] + p.objective.trained_parameters()
    generator = torch.Generator().manual_seed(0)
    for q in trained:
        q.grad = 1e-3 * torch.randn(q.shape, generator=generator, dtype=q.dtype)
    for q in p.objective.trained_parameters():
        q.grad = torch.full_like(q, objective_grad)
    return trained


def _seen_by_the_optimiser(p, trained: list[torch.Tensor]):
    seen: list[torch.Tensor] = []
    hook = p.optimizer.optimizer.register_step_pre_hook(
        lambda *_: seen.extend(q.grad.clone().double() for q in trained))
    return seen, hook


def test_a_step_clamps_the_learned_inverse_temperature_at_100_and_clears_the_gradients(tmp_path: Path) -> None:
    """SGD pushes logit_scale past log 100 (a large negative gradient): after optimizer_step the
    parameter is back at log 100 (the scores use at most 100 anyway, but a parameter left above
    would need as many steps to come back as it took to get there), without clipping every
    gradient is the one the optimiser saw unchanged, and the gradients are cleared (None)."""
    with own_accelerate_state():
        config, p = _prepared(tmp_path, {"name": "mv_dhel", "params": {"temperature": 0.05, "learn_temperature": True},
                                         "lr": 1.0}, max_grad_norm=None)
        (logit_scale,) = p.objective.trained_parameters()
        start = logit_scale.item()
        assert start == pytest.approx(math.log(20.0))
        trained = _set_gradients(p, -50.0)  # one SGD step of lr 1: logit_scale + 50, far past log 100
        given = [q.grad.clone().double() for q in trained]
        seen, hook = _seen_by_the_optimiser(p, trained)
        try:
            optimizer_step(p, config.optimisation.max_grad_norm)
        finally:
            hook.remove()
        assert len(seen) == len(trained)
        for g, s in zip(given, seen):  # max_grad_norm None: nothing clipped
            assert torch.equal(g, s)
        assert logit_scale.item() == MAX_LOGIT_SCALE
        assert float(p.objective.temperature.detach()) == pytest.approx(0.01)
        assert all(q.grad is None for q in trained)


def test_inside_an_accumulation_window_nothing_is_clipped_stepped_or_clamped(tmp_path: Path) -> None:
    """grad_accum_steps 2, first micro-batch: the optimiser does not step, the gradients stay
    (the next micro-batch adds to them) and the learned parameter is neither clipped nor clamped;
    at the second, the window ends: clipped (one coefficient), stepped and clamped."""
    with own_accelerate_state():
        config, p = _prepared(tmp_path, {"name": "mv_dhel", "params": {"temperature": 0.011, "learn_temperature": True},
                                         "lr": 1.0}, max_grad_norm=0.5, grad_accum_steps=2)
        (logit_scale,) = p.objective.trained_parameters()
        with torch.no_grad():  # above the bound, as a resumed or edited parameter can be
            logit_scale.fill_(MAX_LOGIT_SCALE + 1.0)
        trained = _set_gradients(p, 300.0)
        given = [q.grad.clone() for q in trained]
        before = [q.detach().clone() for q in trained]
        with p.accelerator.accumulate(p.model):
            assert not p.accelerator.sync_gradients
            optimizer_step(p, config.optimisation.max_grad_norm)
        assert all(torch.equal(q, b) for q, b in zip(trained, before))  # no step, no clamp
        assert all(q.grad is not None and torch.equal(q.grad, g) for q, g in zip(trained, given))  # not clipped
        assert logit_scale.item() == MAX_LOGIT_SCALE + 1.0

        seen, hook = _seen_by_the_optimiser(p, trained)
        try:
            with p.accelerator.accumulate(p.model):
                assert p.accelerator.sync_gradients
                optimizer_step(p, config.optimisation.max_grad_norm)
        finally:
            hook.remove()
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in given]))
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in seen]))
        assert float(clipped) == pytest.approx(0.5, rel=1e-5)
        for g, s in zip(given, seen):
            assert torch.allclose(s, g.double() * 0.5 / float(total), rtol=1e-5, atol=1e-12)
        assert logit_scale.item() == MAX_LOGIT_SCALE  # stepped down by lr * clipped gradient, then clamped
        assert all(q.grad is None for q in trained)


@pytest.mark.parametrize("bound", [0.5, 1e6])
def test_clip_gradients_returns_the_norm_before_clipping_over_everything_trained(tmp_path: Path, bound: float) -> None:
    """The returned norm is the global norm of the encoder's and the learned parameters'
    gradients before clipping; a bound above it leaves the gradients as they are."""
    with own_accelerate_state():
        _, p = _prepared(tmp_path, {"name": "siglip", "params": {"temperature": 0.1, "bias": -10.0}})
        trained = _set_gradients(p, 3.0)
        given = [q.grad.clone().double() for q in trained]
        total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in given])))
        assert total > math.sqrt(2 * 3.0 ** 2)  # both learned parameters and the encoder count
        norm = clip_gradients(p, bound)
        assert float(norm) == pytest.approx(total, rel=1e-6)
        coefficient = min(1.0, bound / (total + 1e-6))
        for q, g in zip(trained, given):
            assert torch.allclose(q.grad.double(), coefficient * g, rtol=1e-5, atol=1e-12)


ER = {"name": "er", "params": {"temperature": 0.2}, "teacher_momentum": 0.9, "ema_teacher": True}
IPMC = {"name": "ipmc", "params": {"beta": 0.1, "memory_bank_size": 64, "bank_negatives": 8, "critic_steps": 2}}


# ER: the EMA teacher's embeddings and the presence mask (40 % of the modalities absent); IPMC: the
# samples' dataset index (memory bank), a critic trained before the loss, the bank's update after
@pytest.mark.parametrize("objective,missing,chunk", [(ER, 0.4, None), (IPMC, 0.0, None), (ER, 0.4, 4)],
                         ids=["er-teacher-mask", "ipmc-index-critic", "er-teacher-mask-cached"])
def test_the_step_is_the_objective_on_the_encoders_embeddings_then_a_clipped_step(tmp_path: Path, objective, missing,
                                                                                  chunk) -> None:
    """The loss and the critic's metrics train_step returns are the objective's on the
    encoder's embeddings of the batch, with the batch's presence mask, the samples' index and
    the EMA teacher's embeddings (computed here on copies taken before the step); the
    objective's state after the step (IPMC's bank, its critic) is the copy's after its own
    critic step and on_step_end; the gradients the optimiser gets are clipped at
    max_grad_norm (plain step; the cached step: the clipping only, as its chunks draw their
    augmentations and BatchNorm statistics per chunk)."""
    import copy

    from mmviews.config import load_config
    from mmviews.train.build import build_run
    from mmviews.train.setup import make_accelerator, prepare_run
    from mmviews.train.step import train_step

    raw = tiny_config(text=False, image=True, batch_norm=False, dropout=0.0, num_samples=32, batch_size=16, epochs=1)
    raw["cpu"] = True
    raw["data"]["options"]["missing_rate"] = missing
    raw["objective"] = objective
    raw["optimisation"].update({"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "warmup_steps": 0, "max_grad_norm": 1e-3,
                                "encode_chunk_size": chunk})
    with own_accelerate_state():
        config = load_config(write_recipe(tmp_path / "recipe.yaml", raw))
        parts = build_run(config, with_eval=False)
        p = prepare_run(make_accelerator(config, tmp_path / "run"), parts)
        batch = next(iter(p.train_loader))
        assert missing == 0.0 or not batch.all_views_present()
        if p.teacher is not None:  # a teacher that has drifted from the encoder, as after some steps
            with torch.no_grad():
                for q in p.teacher.module.parameters():
                    q.mul_(0.5)
        encoder = copy.deepcopy(p.accelerator.unwrap_model(p.model))
        reference = copy.deepcopy(p.objective)
        teacher = copy.deepcopy(p.teacher)
        assert (teacher is not None) == objective["name"].startswith("er")
        trained = [q for q in p.model.parameters() if q.requires_grad]
        seen: list[float] = []
        hook = p.optimizer.optimizer.register_step_pre_hook(lambda *_: seen.append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(q.grad.double()) for q in trained if q.grad is not None])))))
        torch.manual_seed(1)  # IPMC draws its bank negatives: the same draws in both
        try:
            out, critic_metrics = train_step(p, batch, config.optimisation.max_grad_norm)
        finally:
            hook.remove()

        torch.manual_seed(1)
        z, mask = encoder(batch)
        teacher_z = teacher(batch)[0] if teacher is not None else None
        want_metrics = reference.critic_step(z.detach())
        present = None if batch.all_views_present() else mask  # no mask where every view is there
        want = reference.compute(z, present, index=batch.index if reference.takes_index else None, teacher=teacher_z)
        reference.on_step_end(z.detach(), batch.index)
    assert len(seen) == 1 and seen[0] == pytest.approx(1e-3, rel=1e-4)  # clipped (the loss's gradient is far larger)
    if chunk is not None:  # the cached step's chunks draw augmentations and BatchNorm statistics per chunk
        return
    torch.testing.assert_close(out.loss.detach(), want.loss.detach(), rtol=1e-5, atol=1e-6)
    assert sorted(critic_metrics) == sorted(want_metrics)
    for key in want_metrics:
        torch.testing.assert_close(critic_metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6)
    state, expected = p.objective.state_dict(), reference.state_dict()
    assert sorted(state) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(state[key], expected[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
